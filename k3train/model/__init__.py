"""The K3 model on one device: mixers, AttnRes, LatentMoE, balancers, FLOP counts."""
