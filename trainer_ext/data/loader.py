"""The training DataLoader: our batch sampler (data/samplers.py) or a rank's share of a stream (data/stream.py),
wrapped the way the Trainer wraps its own, so that columns, collation, workers and device placement are transformers'
and accelerate's, and the order is ours."""

from __future__ import annotations

from ..errors import UserError
from ..integrations import internals

# transformers' collators that pad every feature into a tensor through the tokenizer: a column of strings fails there
# with "Unable to create tensor ... (`sentence` in this case) have excessive nesting" (tests/unit/test_first_week.py
# holds each to it); default_data_collator leaves strings out.
PADDING_COLLATORS = ("DataCollatorWithPadding", "DataCollatorForSeq2Seq", "DataCollatorForTokenClassification",
                     "DataCollatorForLanguageModeling", "DataCollatorForMultipleChoice")


def check_training_data(train_dataset, args) -> None:
    """A stream (an IterableDataset, or a dataset without a length) and no --max_steps, in one line: when ExtTrainer is
    built (transformers: a ValueError traceback from Trainer.__init__) and when it trains (a training set given after
    construction; transformers misses an IterableDataset that defines __len__, which ExtTrainer reads as a stream)."""
    from .stream import is_stream

    max_steps = args.max_steps if args is not None else -1  # no arguments: transformers' defaults
    if train_dataset is not None and is_stream(train_dataset) and max_steps <= 0:
        raise UserError(f"the training set ({type(train_dataset).__name__}) is a stream, read in order with no epoch "
                        "ExtTrainer can count: give --max_steps (the optimizer steps to train; max_steps= in "
                        "TrainingArguments)")


def text_columns(dataset) -> list[str]:
    """The columns of a datasets dataset that hold strings (or lists of them); [] when its features are unknown."""
    import datasets

    def text(feature) -> bool:
        if isinstance(feature, datasets.Value):
            return feature.dtype in ("string", "large_string")
        inner = getattr(feature, "feature", None)
        return inner is not None and text(inner)

    features = getattr(dataset, "features", None) or {}
    return [name for name, feature in features.items() if text(feature)]


def check_collatable(dataset, collator, args, description: str) -> None:
    """Columns of strings that reach one of transformers' padding collators (--remove_unused_columns false, or a model
    whose forward takes them): one line naming them before the first batch, not the collator's traceback at it, which
    suggests padding=True and truncation=True."""
    columns = text_columns(dataset)
    kind = type(getattr(collator, "func", collator)).__name__
    if not columns or kind not in PADDING_COLLATORS:
        return
    listed = ", ".join(map(repr, columns))
    keep = ("leave --remove_unused_columns on (it drops the columns the model's forward does not take)"
            if not args.remove_unused_columns else "rename them if the model's forward takes such an argument")
    raise UserError(f"the {description} data's column(s) {listed} hold text, which {kind} cannot batch (it pads token "
                    f"ids into tensors): drop them (dataset.remove_columns([{listed}])), or {keep}")



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
        dataset = internals.remove_unused_columns(trainer, dataset, description)
        check_collatable(dataset, collator, args, description)
    else:
        collator = internals.collator_without_unused_columns(trainer, trainer.data_collator, description)
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
    collator = internals.collator_without_unused_columns(trainer, trainer.data_collator, "training")
    params = {"batch_size": stream.batch_size, "collate_fn": collate_with_placeholders(collator),
              "num_workers": args.dataloader_num_workers, "pin_memory": args.dataloader_pin_memory,
              "persistent_workers": args.dataloader_persistent_workers,
              "prefetch_factor": args.dataloader_prefetch_factor,
              "worker_init_fn": partial(seed_worker, num_workers=args.dataloader_num_workers, rank=args.process_index)}
    if args.dataloader_num_workers > 0 and args.dataloader_multiprocessing_context:
        params["multiprocessing_context"] = args.dataloader_multiprocessing_context
    return DataLoader(stream, **params)
