"""Data parallelism in a cluster (torchrun: DDP, FSDP2) and across clusters (torchft replica groups)."""
