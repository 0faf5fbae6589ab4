"""What a load checks before it trusts a file (issue 25): config.json fields (NaN, range, type,
sane bounds), safetensors headers against their bytes, short checkpoint-mismatch messages, every
malformed tokenizer / generation config named by its path, and a KV pool that honours its memory
budget. No engine is built here (the one test that loads weights is marked integration)."""

import json
import math
import struct
import types

import numpy as np
import pytest

from jtp.config.model_config import ModelConfig
from jtp.errors import CheckpointError, ConfigError

BASE = dict(model_type="qwen3", vocab_size=64, hidden_size=16, num_attention_heads=4, num_key_value_heads=2,
            head_dim=4, num_hidden_layers=2, intermediate_size=32, max_position_embeddings=4096,
            rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False)
HYBRID = dict(BASE, model_type="qwen3_next", num_hidden_layers=4, head_dim=8, num_experts=4, num_experts_per_tok=2)


def assert_one_line(message: str, *parts: str) -> None:
    assert "\n" not in message and len(message) < 400, message
    for part in parts:
        assert part in message, message


# ----------------------------------------------------------------------------- config.json


@pytest.mark.parametrize("edit, field, reason", [
    ({"rms_norm_eps": math.nan}, "rms_norm_eps", "must be a finite number"),
    ({"rms_norm_eps": math.inf}, "rms_norm_eps", "must be a finite number"),
    ({"rms_norm_eps": 0.0}, "rms_norm_eps", "must be positive"),
    ({"rms_norm_eps": -1e-6}, "rms_norm_eps", "must be positive"),
    ({"rms_norm_eps": "1e-6"}, "rms_norm_eps", "must be a finite number"),
    ({"rope_theta": math.nan}, "rope_theta", "positive finite number"),
    ({"rope_theta": math.inf}, "rope_theta", "positive finite number"),
    ({"rope_theta": 0}, "rope_theta", "positive finite number"),
    ({"num_attention_heads": 0}, "num_attention_heads", "must be positive"),
    ({"num_key_value_heads": 2.0}, "num_key_value_heads", "must be an integer"),
    ({"head_dim": -4}, "head_dim", "must be positive"),
    ({"num_key_value_heads": 3}, "num_key_value_heads", "must be a multiple of"),
    ({"vocab_size": 0}, "vocab_size", "must be positive"),
    ({"hidden_size": True}, "hidden_size", "must be an integer"),
    ({"max_position_embeddings": 10**15}, "max_position_embeddings", "past the sane bound 16777216"),
    ({"num_hidden_layers": 100000}, "num_hidden_layers", "past the sane bound 1024"),
    ({"intermediate_size": 10**9}, "intermediate_size", "past the sane bound"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings", "must be true or false"),
    ({"eos_token_id": "</s>"}, "eos_token_id", "must be a token id"),
    ({"eos_token_id": [1, -2]}, "eos_token_id", "must be a token id"),
    ({"bos_token_id": 1.5}, "bos_token_id", "must be a token id"),
    ({"dtype": 16}, "dtype", "must be a string"),
    ({"layer_types": ["full_attention"] * 3}, "layer_types", "list of num_hidden_layers (2) entries"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": math.nan}}, "factor", "must be a number"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 1e12}}, "YaRN", "past the sane bound"),
    ({"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}}, "quantization_config",
     "quant_method 'bitsandbytes' is not served"),
    ({"quantization_config": {"quant_method": "awq", "bits": 4}}, "quantization_config",
     "awq group_size None is not served"),
    ({"quantization_config": {"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}},
     "quantization_config", "fmt 'e5m2' is not served"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config",
     "weight_block_size None is not [rows, columns]"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 0]}}, "quantization_config",
     "weight_block_size [128, 0] is not [rows, columns]"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128],
                              "activation_scheme": "static"}}, "quantization_config", "static activation scales"),
])
def test_bad_config_fields_are_refused_naming_field_and_file(tmp_path, edit, field, reason):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, **edit}))  # NaN / Infinity as Python writes them
    with pytest.raises(ConfigError) as err:
        ModelConfig.from_dir(tmp_path)
    assert_one_line(str(err.value), str(tmp_path / "config.json"), field, reason)


def test_the_base_configs_are_accepted():
    """The control for the refusals above: only the edited field makes a config fail."""
    cfg = ModelConfig.from_hf(dict(BASE, eos_token_id=[1, 2], bos_token_id=0))
    assert (cfg.rms_norm_eps, cfg.num_kv_heads, cfg.eos_token_ids, cfg.bos_token_id) == (1e-6, 2, (1, 2), 0)
    assert ModelConfig.from_hf(dict(BASE, max_position_embeddings=3_000_000)).max_position_embeddings == 3_000_000
    assert len(ModelConfig.from_hf(HYBRID).layer_types) == 4


@pytest.mark.parametrize("edit, reason", [
    ({"layer_types": ["full_attention"] * 3}, "layer_types must be a list of num_hidden_layers (4) entries"),
    ({"layer_types": ["full_attention"] * 3 + ["sliding"]}, "'sliding' is not one of"),
    ({"num_experts": -1}, "'num_experts' must not be negative"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok (5) exceeds num_experts (4)"),
    ({"linear_num_value_heads": 12, "linear_num_key_heads": 8}, "must be a multiple of linear_num_key_heads"),
    ({"linear_conv_kernel_dim": 1000}, "past the sane bound 64"),
])
def test_bad_hybrid_fields_are_refused(edit, reason):
    with pytest.raises(ConfigError) as err:
        ModelConfig.from_hf({**HYBRID, **edit}, source="somewhere/config.json")
    assert_one_line(str(err.value), "somewhere/config.json", reason)


@pytest.mark.parametrize("content, reason", [
    (b"{not json", "not valid JSON"),
    (b"\xff\xfe{}", "not valid JSON"),
    (b"[1, 2]", "expected a JSON object, got list"),
])
def test_config_json_that_is_not_an_object_names_the_file(tmp_path, content, reason):
    (tmp_path / "config.json").write_bytes(content)
    with pytest.raises(ConfigError) as err:
        ModelConfig.from_dir(tmp_path)
    assert_one_line(str(err.value), str(tmp_path / "config.json"), reason)


# ----------------------------------------------------------------------------- safetensors headers


def write_safetensors(path, header: dict, payload: bytes) -> None:
    """A safetensors file written by hand: the 8-byte length, the JSON header, the data."""
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + payload)


F32_DATA = np.arange(6, dtype=np.float32)


@pytest.mark.parametrize("header, payload, reason", [
    # F32 bytes labelled I32 with a shape of twice as many elements: 24 bytes stored, 48 needed.
    ({"w": {"dtype": "I32", "shape": [4, 3], "data_offsets": [0, 24]}}, F32_DATA.tobytes(),
     "24 bytes stored, but I32 of shape [4, 3] needs 48"),
    ({"w": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 24]}}, F32_DATA.tobytes(),
     "24 bytes stored, but BF16 of shape [2, 3] needs 12"),
    # A truncated file: the header promises 24 bytes, 10 are there.
    ({"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}}, F32_DATA.tobytes()[:10],
     "bytes [0, 24) lie past the end of the data (10 bytes; a truncated file?)"),
    ({"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [24, 0]}}, F32_DATA.tobytes(), "are not [begin, end]"),
    ({"w": {"dtype": "F33", "shape": [2, 3], "data_offsets": [0, 24]}}, F32_DATA.tobytes(), "unknown dtype 'F33'"),
    ({"w": {"dtype": "F32", "shape": [2, "3"], "data_offsets": [0, 24]}}, F32_DATA.tobytes(), "is not a list"),
])
def test_safetensors_header_that_lies_names_file_and_tensor(tmp_path, header, payload, reason):
    from jtp.loading.safetensors_header import read_header

    path = tmp_path / "model.safetensors"
    write_safetensors(path, header, payload)
    with pytest.raises(CheckpointError) as err:
        read_header(path)
    assert_one_line(str(err.value), str(path), "tensor 'w'", reason)


def test_safetensors_file_too_short_for_its_header(tmp_path):
    from jtp.loading.safetensors_header import read_header

    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", 10**6) + b"{}")
    with pytest.raises(CheckpointError, match="header length 1000000 does not fit in the file"):
        read_header(path)
    path.write_bytes(b"abc")
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        read_header(path)


def test_an_honest_hand_written_file_reads_back(tmp_path):
    """The control: the same writer with a true header gives the bytes it wrote."""
    from jtp.loading.safetensors_header import TensorInfo, read_header
    from jtp.loading.weights import SafetensorsCheckpoint

    ints = np.array([7, -1], np.int32)
    header = {"__metadata__": {"format": "pt"},
              "w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
              "n": {"dtype": "I32", "shape": [2], "data_offsets": [24, 32]}}
    write_safetensors(tmp_path / "model.safetensors", header, F32_DATA.tobytes() + ints.tobytes())
    assert read_header(tmp_path / "model.safetensors") == {"w": TensorInfo("F32", (2, 3), 0, 24),
                                                           "n": TensorInfo("I32", (2,), 24, 32)}
    ckpt = SafetensorsCheckpoint(tmp_path)
    np.testing.assert_array_equal(ckpt.read("w"), F32_DATA.reshape(2, 3))
    np.testing.assert_array_equal(ckpt.read("n"), ints)
    assert (ckpt.dtype("w"), ckpt.dtype("n")) == ("F32", "I32")


def test_safetensors_index_that_is_garbage_names_the_file(tmp_path):
    from jtp.loading.weights import SafetensorsCheckpoint

    index = tmp_path / "model.safetensors.index.json"
    for content, reason in (("[1]", "not a safetensors index"), ('{"weight_map": {"w": "../x.safetensors"}}',
                                                                 "is not a file name inside the model directory")):
        index.write_text(content)
        with pytest.raises(CheckpointError) as err:
            SafetensorsCheckpoint(tmp_path)
        assert_one_line(str(err.value), str(index), reason)


# ----------------------------------------------------------------------------- checkpoint vs config


def tiny_checkpoint(tmp_path, cfg: ModelConfig, dtype_of=lambda name: np.float32):
    """A safetensors file holding exactly the tensors (zeros) the layout of `cfg` expects."""
    from safetensors.numpy import save_file

    from jtp.models import family_of

    expected = {}
    for source in family_of(cfg).param_layout(cfg, 1).values():
        expected.update(source.expected())
    save_file({n: np.zeros(s, dtype_of(n)) for n, s in expected.items()}, str(tmp_path / "model.safetensors"))
    return expected


def check(tmp_path, cfg: ModelConfig):
    from jtp.loading.weights import (
        SafetensorsCheckpoint,
        check_checkpoint,
        resolve_layout,
    )
    from jtp.models import family_of

    ckpt = SafetensorsCheckpoint(tmp_path)
    check_checkpoint(ckpt, resolve_layout(family_of(cfg).param_layout(cfg, 1), ckpt), cfg)


def test_a_config_of_many_more_layers_gives_a_short_message(tmp_path):
    one_layer = ModelConfig.from_hf(dict(BASE, num_hidden_layers=1))
    expected = tiny_checkpoint(tmp_path, one_layer)
    check(tmp_path, one_layer)  # the control: the checkpoint matches its own config
    per_layer = sum(n.startswith("model.layers.0.") for n in expected)
    with pytest.raises(CheckpointError) as err:
        check(tmp_path, ModelConfig.from_hf(dict(BASE, num_hidden_layers=1000)))
    missing = 999 * per_layer
    assert_one_line(str(err.value), str(tmp_path), f"{missing} expected tensor(s) are missing, e.g. 'model.layers.1.",
                    f" (and {missing - 3} more)")


def test_integer_weights_are_refused_naming_file_and_tensor(tmp_path):
    cfg = ModelConfig.from_hf(dict(BASE, num_hidden_layers=1))
    target = "model.layers.0.mlp.down_proj.weight"
    tiny_checkpoint(tmp_path, cfg, lambda name: np.int32 if name == target else np.float32)
    with pytest.raises(CheckpointError) as err:
        check(tmp_path, cfg)
    assert_one_line(str(err.value), f"1 weight(s) are not floating point, e.g. '{target}' in "
                    f"{tmp_path / 'model.safetensors'} is I32")


# ----------------------------------------------------------------------------- tokenizer files


@pytest.fixture
def tokenizer_dir(tmp_path):
    """A model directory with a tiny real tokenizer.json and valid side files."""
    import tokenizers

    vocab = {"<unk>": 0, "</s>": 1, "hello": 2}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "chat_template": "{{ 1 }}"}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1]}))
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    return tmp_path


@pytest.mark.parametrize("file, content, reason", [
    ("tokenizer.json", "{garbage", "not a readable tokenizers file"),
    ("tokenizer.json", '{"model": 5}', "not a readable tokenizers file"),
    ("tokenizer_config.json", "{garbage", "not valid JSON"),
    ("tokenizer_config.json", '"a string"', "expected a JSON object, got str"),
    ("tokenizer_config.json", '{"eos_token": 5}', "eos_token must be a string"),
    ("tokenizer_config.json", '{"chat_template": [{"template": "x"}]}', "chat_template must be a string"),
    ("generation_config.json", "\xff", "not valid JSON"),
    ("generation_config.json", '{"eos_token_id": "</s>"}', "eos_token_id must be a token id"),
    ("config.json", "[]", "expected a JSON object, got list"),
    ("config.json", '{"text_config": {"bos_token_id": [null, "x"]}}', "text_config.bos_token_id must be a token id"),
])
def test_malformed_tokenizer_files_are_config_errors_naming_the_file(tokenizer_dir, file, content, reason):
    from jtp.engine.tokenizer import Tokenizer

    assert Tokenizer.from_dir(tokenizer_dir).eos_token_ids == (1,)  # the control
    (tokenizer_dir / file).write_bytes(content.encode("latin-1"))
    with pytest.raises(ConfigError) as err:
        Tokenizer.from_dir(tokenizer_dir)
    assert_one_line(str(err.value), str(tokenizer_dir / file), reason)


# ----------------------------------------------------------------------------- the KV pool's budget


class StubRunner:
    """What the pool sizing reads of a runner, with the numbers given."""

    def __init__(self, per_block: int, stats: dict | None = None):
        self.per_block, self.stats, self.num_state_slots = per_block, stats, 0
        self.compiles_ahead, self.params = False, {}  # no step programs to measure: a workspace of 0

    def bytes_per_block(self):
        return self.per_block

    def bytes_per_state_slot(self):
        return 0

    def memory_stats(self):
        return self.stats


def pool_config(max_model_len: int, max_num_seqs: int = 4, block_size: int = 16):
    return types.SimpleNamespace(max_model_len=max_model_len, max_num_seqs=max_num_seqs, block_size=block_size,
                                 gpu_memory_utilization=0.9, num_blocks=None)


def test_cpu_pool_stays_within_its_budget():
    from jtp.engine.memory import host_kv_budget, kv_blocks_for_memory

    CPU_KV_BUDGET_BYTES = host_kv_budget()  # a share of the host's available memory, capped

    per_block = 16 << 10
    runner = StubRunner(per_block)
    # Every row at full length fits: exactly that many blocks.
    assert kv_blocks_for_memory(runner, pool_config(4096)) == 4 * 4096 // 16
    # Past the budget, the budget in 16 KiB blocks, not one block more.
    big = pool_config(65536, max_num_seqs=4096)
    assert kv_blocks_for_memory(runner, big) == CPU_KV_BUDGET_BYTES // per_block
    # One request of max_model_len that cannot fit is refused, saying what to lower.
    with pytest.raises(ConfigError) as err:
        kv_blocks_for_memory(runner, pool_config(300_000_000))
    budget_tokens = CPU_KV_BUDGET_BYTES // per_block * 16
    assert_one_line(str(err.value), "one request of max_model_len 300,000,000 needs 18,750,000 KV blocks",
                    f"lower --max-model-len to at most {budget_tokens:,}", "--num-blocks")


def test_device_pool_refuses_what_one_request_cannot_fit(monkeypatch):
    from jtp.engine.memory import MARGIN_BYTES, kv_blocks_for_memory

    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")  # the allocator was handed the utilization
    stats = {"bytes_limit": (9 << 20) + MARGIN_BYTES, "bytes_in_use": 0}  # 9 MiB beside the margin
    runner = StubRunner(1 << 20, stats)
    assert kv_blocks_for_memory(runner, pool_config(16 * 9)) == 9
    with pytest.raises(ConfigError) as err:
        kv_blocks_for_memory(runner, pool_config(16 * 10))
    assert_one_line(str(err.value), "needs 10 KV blocks", "lower --max-model-len to at most 144",
                    "--gpu-memory-utilization")


def test_an_explicit_pool_larger_than_the_device_is_refused():
    from jtp.engine.memory import check_pool_size

    runner = StubRunner(1 << 20, {"bytes_limit": 1 << 30})
    check_pool_size(1024, 1 << 20, runner)  # exactly the device: allowed
    with pytest.raises(ConfigError, match=r"--num-blocks 1,025: 1.00 GiB of KV cache per device, more than the 1.00"):
        check_pool_size(1025, 1 << 20, runner)
    with pytest.raises(ConfigError, match="--num-blocks"):  # on a CPU the host's RAM bounds it
        check_pool_size(10**15, 1 << 20, StubRunner(1 << 20))


@pytest.mark.integration
def test_an_absurd_context_is_refused_before_the_pool_is_allocated(demo_dir, tmp_path, monkeypatch):
    """The issue's case: max_position_embeddings 16,000,000 on the 2 MB demo model (past the host's budget)."""
    import shutil

    from jtp.config.engine_args import EngineArgs
    from jtp.engine.engine import Engine
    from jtp.worker.runner import ModelRunner

    model = shutil.copytree(demo_dir, tmp_path / "long")
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 16_000_000}))
    allocated = []
    monkeypatch.setattr(ModelRunner, "allocate_cache", lambda self, n: allocated.append(n))
    with pytest.raises(ConfigError) as err:
        Engine.from_args(EngineArgs(model=str(model), skip_tokenizer_init=True, warmup=False))
    assert_one_line(str(err.value), "max_model_len 16,000,000", "lower --max-model-len")
    assert allocated == []
