"""The example scripts' one entry (trainer_ext/tasks/driver.py): each script is its docstring and
`main = script("<task>", __name__)`; imported, it only hands over main(argv); run, it parses the task's flags, runs the
recipe and prints the recipe's report on the main process."""

from types import SimpleNamespace

import pytest

from trainer_ext.tasks import TASKS
from trainer_ext.tasks.driver import argument_classes, script


def test_imported_it_runs_nothing_and_main_takes_the_tasks_flags(capsys):
    for task in TASKS:
        main = script(task, "example_module")  # as a test or a forked preload imports it: no parsing, no exit
        assert callable(main) and len(argument_classes(task)) == 3
        with pytest.raises(SystemExit) as stopped:
            main(["--output_dir", "out", "--no_such_flag", "1"])
        assert stopped.value.code == 2 and "--no_such_flag" in capsys.readouterr().err


def test_the_reports_print_the_recipes_figures_and_where_the_model_went(capsys, tmp_path):
    from trainer_ext.tasks import qa, translation

    args = SimpleNamespace(do_train=True, output_dir=str(tmp_path), process_index=0, should_save=True,
                           save_strategy="steps", push_to_hub=False)
    qa.report({"eval_before_exact_match": 1.0, "eval_before_f1": 2.0, "eval_exact_match": 30.5, "eval_f1": 40.25},
              args)
    translation.report({"eval_bleu": 12.345, "predict_bleu": 7.0}, args)
    out = capsys.readouterr().out
    assert "validation before training: exact match 1.00, F1 2.00" in out
    assert "validation after training: exact match 30.50, F1 40.25" in out
    assert "validation BLEU after training: 12.35" in out and "test BLEU: 7.00" in out
    assert "before training" not in out.split("F1 2.00")[1]  # no BLEU before training was measured, none printed
