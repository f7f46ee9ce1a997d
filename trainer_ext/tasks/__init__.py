"""Reusable task recipes (data preparation, metrics, `run`) shared by the example scripts and experiment files, and
their registry: an experiment file's `task:` names one of TASKS (adding a recipe is its module and one line here)."""

TASKS = {
    "classification": "trainer_ext.tasks.classification",
    "qa": "trainer_ext.tasks.qa",
    "translation": "trainer_ext.tasks.translation",
    "causal_lm": "trainer_ext.tasks.causal_lm",
    "dpo": "trainer_ext.tasks.dpo",
}
# Tasks whose recipe needs more than ExtTrainingArguments (generation settings, DPOConfig's fields).
TRAINING_ARGUMENTS = {"translation": ("trainer_ext.seq2seq", "ExtSeq2SeqTrainingArguments"),
                      "dpo": ("trainer_ext.trl", "ExtDPOConfig")}
