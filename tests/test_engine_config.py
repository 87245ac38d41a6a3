"""EngineConfig / SamplingParams validation and the streaming detokenizer's stop handling."""
import json

import pytest

from deepinfer.config import EngineConfig
from deepinfer.engine import SamplingParams, Tokenizer, Detokenizer, step_seed
from deepinfer.errors import ConfigError


def test_config_from_dict_and_file(tmp_path):
    c = EngineConfig.from_any({"backend": "cpu", "max_batch": 3})
    assert c.backend == "cpu" and c.max_batch == 3
    p = tmp_path / "e.json"
    p.write_text(json.dumps({"precision": "int4", "group_size": 32}))
    c = EngineConfig.from_any(str(p), max_batch=2)
    assert (c.precision, c.group_size, c.max_batch) == ("int4", 32, 2)


@pytest.mark.parametrize("bad, msg", [
    ({"bakend": "cpu"}, "unknown engine config key"),
    ({"precision": "int3"}, "precision"),
    ({"max_batch": 0}, "max_batch"),
    ({"group_size": 48}, "group_size"),
    ({"speculative": {"mtp": True, "draft": 2}}, "speculative"),
    ({"speculative": {"num_draft": 2}}, "set \"method\": \"mtp\""),
    ({"speculative": {"method": "mtp", "num_draft": 0}}, "num_draft"),
])
def test_config_rejects(bad, msg):
    with pytest.raises(ConfigError, match=msg):
        EngineConfig.from_any(bad)


def test_config_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        EngineConfig.from_any(str(tmp_path / "missing.json"))
    p = tmp_path / "bad.json"
    p.write_text("{nope")
    with pytest.raises(ConfigError, match="not valid JSON"):
        EngineConfig.from_any(str(p))


def test_sampling_params():
    assert SamplingParams.from_options(stop="x").stop == ("x",)
    with pytest.raises(ConfigError, match="unknown sampling option"):
        SamplingParams.from_options(temprature=1.0)
    with pytest.raises(ConfigError, match="top_p"):
        SamplingParams.from_options(top_p=0.0)


def test_step_seed_differs_per_row_and_step():
    seeds = {step_seed(7, r, s) for r in range(4) for s in range(50)}
    assert len(seeds) == 200
    assert step_seed(7, 0, 0) == step_seed(7, 0, 0)


@pytest.fixture(scope="module")
def char_tokenizer(tmp_path_factory):
    from tokenizers import Tokenizer as HFTok, models, pre_tokenizers, decoders, trainers

    tok = HFTok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["hello world END of text é ü"] * 10,
                            trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    d = tmp_path_factory.mktemp("tok")
    tok.save(str(d / "tokenizer.json"))
    return Tokenizer(d)


def test_detokenizer_stops_and_holds_back(char_tokenizer):
    ids = char_tokenizer.encode("hello world END of text")
    d = Detokenizer(char_tokenizer, ["END"])
    out = ""
    for t in ids:
        out += d.push(t)
        if d.stopped:
            break
    out += d.flush()
    assert out == "hello world "
    assert d.stopped


def test_detokenizer_multibyte(char_tokenizer):
    ids = char_tokenizer.encode("é ü")
    d = Detokenizer(char_tokenizer, [])
    pieces = [d.push(t) for t in ids] + [d.flush()]
    assert "".join(pieces) == "é ü"
    assert all("\ufffd" not in p for p in pieces)
