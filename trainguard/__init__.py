"""TrainGuard: keeps large LLM training jobs running through hardware and software faults."""

__version__ = "0.1.0"
