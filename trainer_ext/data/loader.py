"""The training DataLoader: our batch sampler (data/samplers.py) or a rank's share of a stream (data/stream.py),
wrapped the way the Trainer wraps its own, so that columns, collation, workers and device placement are transformers'
and accelerate's, and the order is ours."""

from __future__ import annotations


def dataloader_with_batch_sampler(trainer, dataset, description, batch_sampler):
    """A DataLoader over our batch sampler with the Trainer's collator, column removal, workers and seeding, prepared
    by accelerate (device placement) without accelerate re-sharding it."""
    from functools import partial

    import datasets
    from torch.utils.data import DataLoader
    from transformers.trainer_utils import seed_worker

    args = trainer.args
    collator = trainer.data_collator
    if isinstance(dataset, datasets.Dataset):
        dataset = trainer._remove_unused_columns(dataset, description=description)
    else:
        collator = trainer._get_collator_with_removed_columns(trainer.data_collator, description=description)
    params = {"batch_sampler": batch_sampler, "collate_fn": collator, "num_workers": args.dataloader_num_workers,
              "pin_memory": args.dataloader_pin_memory, "persistent_workers": args.dataloader_persistent_workers,
              "prefetch_factor": args.dataloader_prefetch_factor}
    if args.dataloader_num_workers > 0 and args.dataloader_multiprocessing_context:
        params["multiprocessing_context"] = args.dataloader_multiprocessing_context
    params["worker_init_fn"] = partial(seed_worker, num_workers=args.dataloader_num_workers, rank=args.process_index)
    dataloader = trainer.accelerator.prepare(DataLoader(dataset, **params))
    _unshard(dataloader, batch_sampler)
    return dataloader


def _unshard(dataloader, batch_sampler) -> None:
    """accelerate wraps every batch sampler to shard it over ranks; ours is already one rank's share."""
    wrapper = getattr(dataloader, "batch_sampler", None)
    if wrapper is not None and getattr(wrapper, "batch_sampler", None) is batch_sampler:
        wrapper.num_processes, wrapper.process_index = 1, 0


def stream_dataloader(trainer, stream):
    """A DataLoader over one rank's share of a stream, with the Trainer's collator (unused columns removed) and
    workers. Not prepared by accelerate: it would read the stream on the main process and dispatch its batches,
    another order; the Trainer moves each batch to the device itself (_prepare_inputs)."""
    from functools import partial

    from torch.utils.data import DataLoader
    from transformers.trainer_utils import seed_worker

    from .stream import collate_with_placeholders

    args = trainer.args
    collator = trainer._get_collator_with_removed_columns(trainer.data_collator, description="training")
    params = {"batch_size": stream.batch_size, "collate_fn": collate_with_placeholders(collator),
              "num_workers": args.dataloader_num_workers, "pin_memory": args.dataloader_pin_memory,
              "persistent_workers": args.dataloader_persistent_workers,
              "prefetch_factor": args.dataloader_prefetch_factor,
              "worker_init_fn": partial(seed_worker, num_workers=args.dataloader_num_workers, rank=args.process_index)}
    if args.dataloader_num_workers > 0 and args.dataloader_multiprocessing_context:
        params["multiprocessing_context"] = args.dataloader_multiprocessing_context
    return DataLoader(stream, **params)
