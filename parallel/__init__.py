"""Process groups, TP/SP layers, gradient reduction, ZeRO-1, pipeline, context and expert
parallelism: imported as `k3train.parallel` (this folder is linked as `k3train/parallel`)."""

if __name__ != "k3train.parallel":
    raise ImportError(f"import k3train.parallel, not {__name__}: parallel/ is part of the k3train package")
