"""tessera: train large neural networks with every form of parallelism on torch.distributed."""

__version__ = "0.1.0"
