"""TORCH_CUDA_ARCH_LIST with an arch-specific letter (9.0a, set by many Hopper images) must not kill DeepSpeed's op
build: it is normalised once and said; an entry nothing can read stops the run before any work, naming the variable.
DeepSpeed's own compute-capability parser is the oracle (it runs without a GPU)."""

import os

import pytest

from trainer_ext.backends.deepspeed.cuda_arch import ArchListError, for_deepspeed, prepare_for_deepspeed


def deepspeed_parses(value: str) -> bool:
    """What DeepSpeed 0.19's FusedAdam builder makes of this value in JIT mode (how a ZeRO run builds it)."""
    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder

    builder = FusedAdamBuilder()
    builder.jit_mode, builder._jit_arch_list = True, value
    saved = os.environ.get("TORCH_CUDA_ARCH_LIST")
    try:
        builder.compute_capability_args()
        return True
    except ValueError:
        return False
    finally:  # the builder rewrites the variable
        os.environ.pop("TORCH_CUDA_ARCH_LIST", None) if saved is None else os.environ.update(
            TORCH_CUDA_ARCH_LIST=saved)


@pytest.mark.deepspeed
@pytest.mark.parametrize("value,expected", [
    ("9.0a", "9.0"), ("8.0;9.0a+PTX", "8.0;9.0+PTX"), ("7.5 8.6 9.0a", "7.5;8.6;9.0"), ("10.0f;12.0a", "10.0;12.0"),
    ("8.0; 9.0a ", "8.0;9.0"),
])
def test_letter_suffixes_are_dropped_so_deepspeed_can_build(value, expected):
    """The measured failure (9.0a) and its relatives: DeepSpeed rejects the raw value, accepts ours."""
    assert not deepspeed_parses(value)
    assert for_deepspeed(value) == expected
    assert deepspeed_parses(expected)


@pytest.mark.deepspeed
@pytest.mark.parametrize("value", ["8.0;9.0", "8.6+PTX", "9.0 10.0"])
def test_values_deepspeed_reads_are_left_alone(value):
    """A TORCH_CUDA_ARCH_LIST that DeepSpeed already builds with must not be rewritten or warned about."""
    env = {"TORCH_CUDA_ARCH_LIST": value}
    assert prepare_for_deepspeed(env) is None and env["TORCH_CUDA_ARCH_LIST"] == value
    assert deepspeed_parses(value)


@pytest.mark.parametrize("value", ["sm_90", "Hopper", "90", "9.0;9.x"])
def test_unreadable_entries_are_an_error_naming_the_variable_and_the_fix(value):
    """An arch list nothing can read (sm_90, Hopper) must stop the run naming the variable and a working value."""
    with pytest.raises(ArchListError, match=r"TORCH_CUDA_ARCH_LIST=.*e\.g\. TORCH_CUDA_ARCH_LIST=\"8\.0;9\.0\""):
        for_deepspeed(value)


def test_normalised_for_the_process_and_said_once(caplog, monkeypatch):
    """The corrected list must reach DeepSpeed's op build, and the note appear once on rank 0, not on every rank."""
    from trainer_ext.backends.deepspeed import cuda_arch

    monkeypatch.setattr(cuda_arch, "_said", [])  # as in a fresh process: nothing said yet
    with caplog.at_level("WARNING", logger="trainer_ext.backends.deepspeed.cuda_arch"):
        assert prepare_for_deepspeed({"TORCH_CUDA_ARCH_LIST": "9.0a", "RANK": "1"}) is not None
    assert caplog.records == []  # another rank: normalised, not said
    env = {"TORCH_CUDA_ARCH_LIST": "9.0a", "RANK": "0"}
    with caplog.at_level("WARNING", logger="trainer_ext.backends.deepspeed.cuda_arch"):
        note = prepare_for_deepspeed(env)
        prepare_for_deepspeed({"TORCH_CUDA_ARCH_LIST": "9.0a", "RANK": "0"})
    assert env["TORCH_CUDA_ARCH_LIST"] == "9.0" and "'9.0a' -> '9.0'" in note
    assert [r.getMessage() for r in caplog.records] == [note]  # once per process, main process only


@pytest.mark.deepspeed
def test_a_bad_value_stops_argument_parsing_with_exit_2_on_gpu_ranks(tmp_path, monkeypatch, capsys):
    """A user's environment mistake is one line and exit status 2, before any model exists. The check runs where
    DeepSpeed builds CUDA ops: this machine has no GPU, so the arguments are told the ranks are not CPU ranks."""
    from trainer_ext.environment import launcher as runtime
    from trainer_ext import args as args_module

    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "sm_90")
    monkeypatch.setattr(runtime, "cpu_ranks", lambda args: False)
    parser = args_module.ExtArgumentParser(args_module.ExtTrainingArguments)
    with pytest.raises(SystemExit) as stopped:
        parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--deepspeed", "zero2_minimal"])
    assert stopped.value.code == 2
    assert "TORCH_CUDA_ARCH_LIST='sm_90'" in capsys.readouterr().err
