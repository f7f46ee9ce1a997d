"""The FSDP2 backend: settings.py (pure: the flags resolved into FSDPSettings) and backend.py (fully_shard on CPU ranks
and GPUs, partitioned loading, the optimizer's shards in checkpoints)."""
