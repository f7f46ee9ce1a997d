"""What users write, checked and read: flags.py (ExtTrainingArguments and its parser), values.py (a written value read as its field's type), removed.py (the flags transformers 5 removed, with
what to type instead), checks.py (every flag check), ranges.py (the tables of valid values), optimizer.py
(OptimizerSettings, SchedulerSettings and the warmup rules). Imports none of them, so the pure translator can read the
ranges without torch."""
