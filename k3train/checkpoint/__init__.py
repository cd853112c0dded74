"""Sharded, atomic, resumable checkpoints (torch.distributed.checkpoint) and Hugging Face name mapping."""
