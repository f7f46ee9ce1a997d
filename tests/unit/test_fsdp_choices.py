"""FSDP2's choices pinned in this process (no launcher): what each `--fsdp` option and `--fsdp_config` key resolves
to, what fully_shard is given on CPU and CUDA ranks (mesh, process group, MixedPrecisionPolicy, offload), which modules
are sharded on their own, the empty models partitioned loading builds, and shard() itself on a mesh of one rank.
tests/integration/test_fsdp.py trains with them on 2 CPU ranks, tests/integration/test_cuda.py on GPUs."""

from types import SimpleNamespace

import pytest
import torch
from transformers import BertConfig, BertForMaskedLM, BertForSequenceClassification

from trainer_ext.backends import RunSettings
from trainer_ext.backends.fsdp.backend import FSDPBackend, shard, sharding_choices, wrap_units
from trainer_ext.backends.fsdp.settings import FSDP1_KEYS, FSDP1_OPTIONS, FSDPSettings, resolve_settings
from trainer_ext.errors import UserError

CONFIG = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


@pytest.mark.parametrize("fsdp,config,expected", [
    ("full_shard", {}, dict(reshard_after_forward=True, offload=False)),
    ("shard_grad_op", {}, dict(reshard_after_forward=False)),
    ("auto_wrap", {"reshard_after_forward": "false"}, dict(reshard_after_forward=False)),  # the key alone, as text
    ("full_shard offload", {}, dict(offload=True)),
    ("full_shard", {"offload_params": True}, dict(offload=True)),  # accelerate config's fsdp_offload_params
    ("full_shard", {"cpu_offload": "true"}, dict(offload=True)),
    ("full_shard auto_wrap", {"transformer_layer_cls_to_wrap": ["BertLayer"]}, dict(layer_classes=("BertLayer",))),
    ("full_shard auto_wrap", {"fsdp_transformer_layer_cls_to_wrap": "BertLayer, BertEmbeddings"},
     dict(layer_classes=("BertLayer", "BertEmbeddings"))),  # accelerate's prefixed, comma-separated form
    ("full_shard auto_wrap", {"auto_wrap_policy": "size_based_wrap", "min_num_params": 1000},
     dict(auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=1000)),
    ("full_shard", {"activation_checkpointing": True}, dict(activation_checkpointing=True)),
    ("full_shard", {"cpu_ram_efficient_loading": "true"}, dict(cpu_ram_efficient_loading=True)),
])
def test_each_option_and_key_resolves_to_its_setting(fsdp, config, expected):
    """An option word or fsdp_config key (in any of the spellings transformers and accelerate accept) would be read
    as another setting, or ignored."""
    settings, _, problems = resolve_settings(fsdp, config)
    assert problems == []
    assert {key: getattr(settings, key) for key in expected} == expected


def test_every_fsdp1_only_option_and_key_is_refused_by_name():
    """An FSDP1 sharding strategy or setting would be accepted and silently not applied by FSDP2."""
    for word in FSDP1_OPTIONS:
        assert any(f"--fsdp {word}: a sharding strategy of FSDP1 only" in p for p in resolve_settings(word, None)[2])
    for key in FSDP1_KEYS:
        assert any(f"--fsdp_config {key}: an FSDP1 setting" in p
                   for p in resolve_settings("full_shard", {key: True})[2])
    assert any("disagree" in p for p in resolve_settings("full_shard", {"reshard_after_forward": False})[2])


@pytest.mark.parametrize("device,precision,offload,expected", [
    ("cpu", None, False, ("cpu", None, None, "OffloadPolicy")),
    ("cpu", "bf16", False, ("cpu", "bfloat16", "float32", "OffloadPolicy")),
    ("cuda", None, False, ("cuda", None, None, "OffloadPolicy")),
    ("cuda", "bf16", False, ("cuda", "bfloat16", "float32", "OffloadPolicy")),
    ("cuda", "fp16", True, ("cuda", "float16", "float32", "CPUOffloadPolicy")),
])
def test_what_fully_shard_is_given_on_each_device(device, precision, offload, expected):
    """On GPUs the mesh would be built on the CPU, 16-bit training would reduce gradients in 16 bits or keep 16-bit
    master weights (the parameters fully_shard holds stay in their fp32), or offload would not move the shards to CPU
    memory."""
    choices = sharding_choices(device, precision == "bf16", precision == "fp16", offload)
    assert tuple(choices.values()) == expected
    assert list(choices) == ["mesh_device_type", "param_dtype", "reduce_dtype", "offload_policy"]


def test_the_units_sharded_on_their_own():
    """transformer_layer_cls_to_wrap, SIZE_BASED_WRAP and NO_WRAP would shard other modules than asked, a module
    holding a tied weight would be split from its twin, or a class the model lacks would be ignored."""
    torch.manual_seed(0)
    model = BertForMaskedLM(CONFIG)
    layers = list(model.bert.encoder.layer)
    assert wrap_units(model, FSDPSettings(layer_classes=("BertLayer",))) == layers[::-1]
    # The embeddings hold the word embeddings the decoder shares: they stay in the model's own group.
    assert wrap_units(model, FSDPSettings(layer_classes=("BertLayer", "BertEmbeddings"))) == layers[::-1]
    classifier = BertForSequenceClassification(CONFIG)
    assert classifier.bert.embeddings in wrap_units(classifier, FSDPSettings(layer_classes=("BertEmbeddings",)))
    assert wrap_units(model, FSDPSettings(auto_wrap_policy="NO_WRAP", layer_classes=("BertLayer",))) == []
    sized = wrap_units(classifier, FSDPSettings(auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=2000))
    assert sized and all(sum(p.numel() for p in unit.parameters()) >= 2000 for unit in sized)
    assert len({id(p) for unit in sized for p in unit.parameters()}) == sum(
        len(list(unit.parameters())) for unit in sized)  # no parameter in two units
    # Each layer (2,224 parameters) is under the size, both together over it: the encoder is a unit, never the
    # ModuleList holding them (fully_shard refuses a container without a forward).
    assert classifier.bert.encoder in wrap_units(classifier, FSDPSettings(auto_wrap_policy="SIZE_BASED_WRAP",
                                                                          min_num_params=2300))
    with pytest.raises(UserError, match="BertBlock is not a module class of BertForMaskedLM .its repeated classes: "):
        wrap_units(model, FSDPSettings(layer_classes=("BertBlock",)))


@pytest.fixture
def as_launched_rank(monkeypatch):
    """The variables a launcher's rank has: sharded_loading's prepare_process then forms no 1-rank group here."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")


def loading_args(rank, world_size=2, efficient=True, place_model_on_device=False):
    """Arguments as ExtTrainingArguments hold them (the FSDP backend leaves the model where it was built)."""
    from transformers.training_args import ParallelMode

    mode = ParallelMode.DISTRIBUTED if world_size > 1 else ParallelMode.NOT_DISTRIBUTED
    return SimpleNamespace(fsdp="full_shard", fsdp_config={"cpu_ram_efficient_loading": efficient},
                           device=torch.device("cpu"),  # the process group formed (prepare_process)
                           process_index=rank, world_size=world_size, place_model_on_device=place_model_on_device,
                           parallel_mode=mode, ddp_timeout=1800,
                           run_settings=RunSettings("fsdp", resolve_settings("full_shard", {
                               "cpu_ram_efficient_loading": efficient})[0], place_model_on_device=place_model_on_device,
                                                    global_batch="settled when parsed"))


def test_sharded_loading_builds_the_model_empty_on_ranks_after_the_first(tmp_path, as_launched_rank):
    """Partitioned loading: a rank after the first would hold the whole model while loading (a class called directly,
    from_config or from_pretrained), lose a tied weight, leave a device map that makes transformers' Trainer take the
    model for model-parallel, or leave torch's default device or from_pretrained changed; rank 0, one process and runs
    without cpu_ram_efficient_loading would not load normally."""
    from transformers import AutoModelForMaskedLM, PreTrainedModel

    from trainer_ext import sharded_loading

    BertForMaskedLM(CONFIG).save_pretrained(tmp_path)
    loader = PreTrainedModel.__dict__["from_pretrained"]
    with sharded_loading(loading_args(rank=1)):
        built = [BertForMaskedLM(CONFIG), AutoModelForMaskedLM.from_config(CONFIG),
                 AutoModelForMaskedLM.from_pretrained(tmp_path)]
    for model in built:
        assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"meta"}
        assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight
        assert getattr(model, "hf_device_map", None) is None
    assert PreTrainedModel.__dict__["from_pretrained"] is loader and torch.empty(1).device.type == "cpu"
    for args in (loading_args(rank=0), loading_args(rank=1, world_size=1), loading_args(rank=1, efficient=False)):
        with sharded_loading(args):
            model = AutoModelForMaskedLM.from_pretrained(tmp_path)
        assert {p.device.type for p in model.parameters()} == {"cpu"}
    fields, run = FSDPBackend.settle(SimpleNamespace(fsdp="full_shard", fsdp_config=None, use_cpu=True), batch=None)
    assert run.place_model_on_device is False  # an empty model cannot be moved


def test_partitioned_loading_with_stock_arguments_is_one_line(tmp_path, as_launched_rank):
    """Stock TrainingArguments leave placement to transformers' Trainer (their place_model_on_device is None), which
    would move rank 1's empty model to the device and fail deep inside torch ("Cannot copy out of meta tensor")."""
    from transformers import TrainingArguments

    from trainer_ext import sharded_loading
    from trainer_ext.errors import ArgumentsError

    assert TrainingArguments(output_dir=str(tmp_path), report_to="none").place_model_on_device is None
    for rank in (0, 1):  # every rank stops, before rank 0 loads anything
        with pytest.raises(ArgumentsError) as raised, sharded_loading(loading_args(rank, place_model_on_device=None)):
            pass
        assert "cpu_ram_efficient_loading needs trainer_ext's ExtTrainingArguments" in str(raised.value)
        assert "\n" not in str(raised.value)


@pytest.fixture(scope="module")
def world_of_one():
    """A gloo process group of one rank in this process: fully_shard on a mesh of one."""
    import torch.distributed as dist

    from conftest import free_port

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_shard_applies_the_settings(world_of_one, reshard_after_forward):
    """shard() would not pass reshard_after_forward (shard_grad_op), bf16 compute over fp32 shards
    (MixedPrecisionPolicy), the wrap units or activation checkpointing on to fully_shard."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    model = BertForSequenceClassification(CONFIG)
    settings = FSDPSettings(reshard_after_forward=reshard_after_forward, layer_classes=("BertLayer",),
                            activation_checkpointing=True)
    args = SimpleNamespace(device=torch.device("cpu"), world_size=1, process_index=0, bf16=True, fp16=False,
                           run_settings=RunSettings("fsdp", settings))
    shard(model, settings, args)
    assert isinstance(model, FSDPModule) and all(isinstance(layer, FSDPModule) for layer in model.bert.encoder.layer)
    assert all(layer.gradient_checkpointing for layer in model.bert.encoder.layer)
    assert {type(p) for p in model.parameters()} == {DTensor} and {p.dtype for p in model.parameters()} == {
        torch.float32}
    seen = {}
    query = model.bert.encoder.layer[0].attention.self.query
    query.register_forward_pre_hook(lambda module, inputs: seen.update(dtype=module.weight.dtype))
    model.train()
    loss = model(input_ids=torch.randint(1, 64, (2, 8)), labels=torch.tensor([0, 1])).loss
    assert seen["dtype"] == torch.bfloat16  # computed with 16-bit copies of the fp32 shards
    # After forward a layer is resharded (full_shard) or kept gathered until its backward (shard_grad_op).
    assert isinstance(query.weight, DTensor) is reshard_after_forward
    loss.backward()
    assert isinstance(query.weight, DTensor) and query.weight.grad.dtype == torch.float32


def test_the_gpu_benchmark_row_is_fsdp2_full_shard_in_bf16_beside_zero3():
    """benchmarks/gpu.py's FSDP2 row (a GPU session's only measurement of it) would run other settings than it names,
    fail to parse after the GPU was lent, or fall behind rows the time budget cuts first."""
    import importlib.util
    import sys

    from conftest import REPO

    spec = importlib.util.spec_from_file_location("gpu", REPO / "benchmarks" / "gpu.py")
    gpu = sys.modules["gpu"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu)
    names = [config.name for config in gpu.CONFIGS]
    row = next(config for config in gpu.CONFIGS if config.name.startswith("FSDP2"))
    assert names.index(row.name) == names.index("ZeRO-3, ExtTrainer (zero3)") + 1
    assert row.precisions == ("bf16",) and row.launcher == "torchrun" and row.flags[0] == "--fsdp"
    settings, _, problems = resolve_settings(row.flags[1], row.flags[3])
    assert problems == [] and settings.reshard_after_forward and settings.layer_classes == ("BertLayer",)
