"""Generated inputs for the parsers that face the outside: the request (JSON text and raw bytes), --input files,
config.json and safetensors headers, and the numeric options.

Each case may end only as documented: the parsed values, or one UserError whose message is one short line naming
where the problem is (main turns it into exit 2). Any other exception fails the test, and so would a hang. A fixed
seed (derandomize) and example budget keep the run to seconds; every defect of issue 13 is an explicit example.
"""
import contextlib
import io
import json
import math
import os

import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

import torch

import prefill
import prefill_corpus

FUZZ = settings(max_examples=300, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow])

# Text with the characters that break parsers: lone surrogates, line separators, quotes, backslashes.
any_text = st.text(st.one_of(st.characters(), st.characters(categories=["Cs"]), st.sampled_from('\n\r\u2028"\\[')),
                   max_size=20)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | any_text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(any_text, inner, max_size=4), max_leaves=12)


def raw_json(value):
    # JSON with non-ASCII characters written as they are: a lone surrogate becomes bytes that are not UTF-8
    return json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")


requests = st.one_of(
    st.binary(max_size=60),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.lists(any_text, max_size=6).map(lambda t: json.dumps(t).encode()),  # escaped, "\ud800" included
    st.lists(any_text, max_size=6).map(raw_json),
    st.lists(st.text(max_size=20), max_size=6).map(raw_json),  # valid: mostly accepted
)


def refusal(call, *args):
    """call(*args), or the message of the UserError it raised. Any other exception fails the test."""
    try:
        return call(*args), None
    except prefill.UserError as e:
        message = str(e)
        assert message and "\n" not in message and len(message) < 1000, message
        return None, message


@pytest.fixture(scope="session")
def tokenizer(qwen_tokenizer_dir):
    return prefill.load_tokenizer(qwen_tokenizer_dir)


# ----------------------------------------------------------------------------- the request

@FUZZ
@given(data=requests)
@example(data=b'["\\ud800"]')                    # a lone surrogate, escaped: lost the request to a TypeError
@example(data=b'["ok", "a\xffb"]')                # bytes that are not UTF-8
@example(data=b"[" * 100_000)                    # RecursionError
@example(data=b"[" * 100_000 + b"]" * 100_000)
@example(data=b'"one string"')
@example(data=b'["\xed\xa0\x80"]')                # a surrogate encoded as UTF-8 bytes (invalid UTF-8)
def test_request(data, tokenizer):
    texts, message = refusal(prefill.parse_request, data)
    if message is not None:
        assert message.startswith("stdin: ")
        return
    # accepted: exactly the array of strings the bytes hold (so they were UTF-8), and the tokenizer takes them
    assert texts == json.loads(data.decode("utf-8"))
    assert all(isinstance(t, str) for t in texts)
    assert len(tokenizer(texts) if texts else []) == len(texts)


# ----------------------------------------------------------------------------- --input files

def expected_lines(data, text_field="text"):
    """What a JSON-lines file holds, by the spec: ([(text, id or NO_ID)], None) or (None, 1-based number of the first
    bad line)."""
    records = []
    for number, line in enumerate(data.split(b"\n"), 1):
        if not line.strip(b" \t\r"):
            continue
        try:
            value = json.loads(line.decode("utf-8"))
            record = (value.get(text_field), value.get("id", prefill_corpus.NO_ID)) if isinstance(value, dict) else \
                (value, prefill_corpus.NO_ID)
            if not isinstance(record[0], str):
                return None, number
            record[0].encode("utf-8")  # an escaped lone surrogate
        except ValueError:  # not UTF-8, not JSON, or a surrogate (UnicodeError is a ValueError)
            return None, number
        records.append(record)
    return records, None


objects = st.fixed_dictionaries({}, optional={"text": any_text | json_values, "body": any_text, "id": json_values,
                                              "other": json_values})
line_kinds = st.one_of(
    any_text.map(lambda t: json.dumps(t).encode()),   # a good line, or an escaped lone surrogate
    any_text.map(raw_json),                           # raw: U+2028 inside a string, or bytes that are not UTF-8
    objects.map(lambda o: json.dumps(o).encode()),    # a record object, with the text field or not
    objects.map(raw_json),
    st.sampled_from([b"", b"  ", b"\r", b"\t "]),      # blank
    json_values.map(lambda v: json.dumps(v).encode()),  # another JSON value
    st.binary(max_size=8).filter(lambda b: b"\n" not in b),
)


def records_of(path, text_field):
    return [(r.text, r.id) for r in prefill_corpus.read_records(path, text_field=text_field)]


def id_key(value):  # ids compared as JSON text (a NaN id equals itself)
    return "absent" if value is prefill_corpus.NO_ID else json.dumps(value)


@FUZZ
@given(lines=st.lists(line_kinds, max_size=6), newline_at_end=st.booleans(), array=st.booleans(),
       text_field=st.sampled_from(["text", "body"]))
@example(lines=[b'"only one"'], newline_at_end=True, array=False, text_field="text")  # one line was "got str"
@example(lines=[b'"a"', b"", b"{x", b'"b"'], newline_at_end=True, array=False, text_field="text")  # bad line 3
@example(lines=[b'"a"', b"", b"7"], newline_at_end=False, array=False, text_field="text")
@example(lines=[b'"x\xe2\x80\xa8y"'], newline_at_end=True, array=False, text_field="text")  # a raw U+2028: no break
@example(lines=[b'{"text": "a", "id": null}', b'{"body": "b", "text": 1}'], newline_at_end=True, array=False,
         text_field="body")  # the first has no body: line 1
def test_input_file(tmp_path_factory, lines, newline_at_end, array, text_field):
    path = tmp_path_factory.getbasetemp() / "input.txt"
    if array:  # the same content as one JSON array, over several lines
        data = b"[\n" + b",\n".join(line for line in lines if line.strip()) + b"\n]"
    else:
        data = b"\n".join(lines) + (b"\n" if newline_at_end else b"")
    path.write_bytes(data)
    records, message = refusal(records_of, str(path), text_field)
    if message is not None:
        assert message.startswith(str(path))
    if array or data.lstrip(b" \t\r\n").startswith(b"["):
        if records is not None:
            values = json.loads(data.decode("utf-8"))
            assert [text for text, _ in records] == [v[text_field] if isinstance(v, dict) else v for v in values]
        return
    want, bad_line = expected_lines(data, text_field)
    assert [(text, id_key(i)) for text, i in records or []] == [(text, id_key(i)) for text, i in want or []]
    if bad_line is not None:
        where = f"{path} line {bad_line}"
        assert message.startswith(where) and not message[len(where)].isdigit(), message


def test_input_file_that_cannot_be_read_is_named(tmp_path):
    _, message = refusal(records_of, str(tmp_path / "missing.jsonl"), "text")
    assert message.startswith(f"cannot read {tmp_path / 'missing.jsonl'}")


# ----------------------------------------------------------------------------- config.json

GOOD_CONFIG = dict(model_type="qwen3", hidden_size=64, intermediate_size=160, num_hidden_layers=4,
                   num_attention_heads=8, num_key_value_heads=2, head_dim=16, vocab_size=151936, rms_norm_eps=1e-6,
                   rope_theta=1e6, tie_word_embeddings=False)
# each family's own keys, on the same geometry: the fuzzer changes or drops any of them
FAMILY_CONFIGS = [
    GOOD_CONFIG,
    dict(GOOD_CONFIG, model_type="llama", attention_bias=True, mlp_bias=False, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}),
    dict(GOOD_CONFIG, model_type="mistral", sliding_window=8),
    dict(GOOD_CONFIG, model_type="qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=2),
    dict(GOOD_CONFIG, model_type="gemma2", query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
         final_logit_softcapping=3.0, sliding_window=8, hidden_activation="gelu_pytorch_tanh"),
    {"model_type": "gemma3", "text_config": dict(GOOD_CONFIG, model_type="gemma3_text", sliding_window=8,
                                                 layer_types=["sliding_attention", "full_attention"] * 2,
                                                 rope_parameters={"full_attention": {"rope_type": "linear",
                                                                                     "factor": 8.0},
                                                                  "sliding_attention": {"rope_theta": 1e4}})},
]


@st.composite
def configs(draw):
    kind = draw(st.sampled_from(["fields", "fields", "fields", "value", "bytes"]))
    if kind == "bytes":
        return draw(st.binary(max_size=40))
    if kind == "value":
        return json.dumps(draw(json_values)).encode()
    config = json.loads(json.dumps(draw(st.sampled_from(FAMILY_CONFIGS))))
    inner = config.get("text_config", config)
    keys = sorted(inner) + ["rope_parameters", "rope_scaling", "layer_types", "sliding_window", "quantization_config",
                            "partial_rotary_factor", "use_bidirectional_attention"]
    for key in draw(st.lists(st.sampled_from(keys), max_size=3)):
        change = draw(st.sampled_from(["drop", "value", "number"]))
        if change == "drop":
            inner.pop(key, None)
        else:
            inner[key] = draw(json_values if change == "value" else st.integers(-3, 40) | st.floats())
    return json.dumps(config).encode()


@FUZZ
@given(data=configs())
@example(data=b"[1, 2]")                                            # an array: AttributeError before
@example(data=json.dumps(dict(GOOD_CONFIG, hidden_size="64")).encode())  # a string: TypeError before
@example(data=json.dumps(dict(GOOD_CONFIG, rope_parameters=[1])).encode())
@example(data=json.dumps(dict(GOOD_CONFIG, head_dim=15)).encode())
@example(data=b"[" * 100_000)
def test_config(tmp_path_factory, data):
    folder = tmp_path_factory.getbasetemp() / "config"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_bytes(data)
    cfg, message = refusal(prefill.ModelConfig.from_dir, folder)
    if message is not None:
        assert str(folder / "config.json") in message
        return
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                "vocab_size"):
        assert type(getattr(cfg, key)) is int and getattr(cfg, key) > 0
    assert cfg.num_attention_heads % cfg.num_key_value_heads == 0 and cfg.head_dim % 2 == 0
    assert 0 < cfg.rms_norm_eps < math.inf and type(cfg.tie_word_embeddings) is bool
    assert len(cfg.ropes) == len(cfg.attention) == cfg.num_hidden_layers
    for rope in cfg.ropes:  # every RoPE gives finite angles
        assert rope.kind in prefill.ROPE_KINDS and torch.isfinite(rope.inv_freq(cfg.head_dim)).all()
    for how in cfg.attention:
        assert 0 < how.scale < math.inf and (how.window is None or type(how.window) is int and how.window > 0)
        assert how.softcap is None or 0 < how.softcap < math.inf
    assert cfg.final_softcap is None or 0 < cfg.final_softcap < math.inf


# ----------------------------------------------------------------------------- safetensors headers

ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4}


@st.composite
def safetensors_files(draw):
    if draw(st.integers(0, 9)) == 0:
        return draw(st.binary(max_size=40))
    header, offset = {}, 0
    for i, (dtype, shape) in enumerate(draw(st.lists(st.tuples(st.sampled_from(sorted(ITEMSIZE)),
                                                              st.lists(st.integers(0, 4), max_size=3)), max_size=4))):
        nbytes = math.prod(shape) * ITEMSIZE[dtype]
        header[f"t{i}"] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if draw(st.booleans()):
        header["__metadata__"] = {"format": "pt"}
    if header and draw(st.booleans()):  # one field of one entry, or a whole entry, becomes any JSON value
        name = draw(st.sampled_from(sorted(header)))
        field = draw(st.sampled_from(["dtype", "shape", "data_offsets", None]))
        if field is None:
            header[name] = draw(json_values)
        else:
            header[name][field] = draw(json_values | st.integers(-2, 2**65) | st.lists(st.integers(-2, 40)))
    if draw(st.integers(0, 9)) == 0:
        header = draw(json_values)
    raw = json.dumps(header).encode()
    data = bytes(draw(st.sampled_from([offset, offset, 0, max(0, offset - 1), offset + 7])))
    length = draw(st.one_of(st.just(len(raw)), st.just(len(raw)), st.integers(0, 2**64 - 1)))
    return length.to_bytes(8, "little") + raw + data


def safetensors_bytes(header, data, length=None):
    raw = json.dumps(header).encode()
    return (len(raw) if length is None else length).to_bytes(8, "little") + raw + data


ENTRY = {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 12]}


@FUZZ
@given(data=safetensors_files())
@example(data=safetensors_bytes({"t": ENTRY}, bytes(12), length=2**40))       # MemoryError before
@example(data=safetensors_bytes({"t": ENTRY}, bytes(12), length=2**64 - 1))   # OverflowError before
@example(data=safetensors_bytes({"t": dict(ENTRY, shape=[3, 3])}, bytes(18)))  # shape disagrees with the bytes
@example(data=safetensors_bytes({"t": dict(ENTRY, dtype=["BF16"])}, bytes(12)))
@example(data=safetensors_bytes([ENTRY], b""))
@example(data=b"\x05\x00")
def test_safetensors_header(tmp_path_factory, data):
    folder = tmp_path_factory.getbasetemp() / "safetensors"
    folder.mkdir(exist_ok=True)
    (folder / "model.safetensors").write_bytes(data)
    ckpt, message = refusal(prefill.Checkpoint, folder)
    if message is not None:
        assert str(folder / "model.safetensors") in message
        return
    try:  # accepted: every tensor lies inside the file, with the bytes its dtype and shape need
        for name, (_, dtype, shape, _, nbytes) in ckpt.tensors.items():
            t = ckpt.get(name, shape)
            assert t.dtype == dtype and t.numel() * dtype.itemsize == nbytes
    finally:
        for fd, _ in ckpt.files:
            os.close(fd)


# ----------------------------------------------------------------------------- numeric options

@FUZZ
@given(option=st.sampled_from(["--gpu-memory", "--chunk-tokens", "--wave-tokens"]),
       value=st.one_of(st.text(max_size=12), st.floats().map(repr), st.integers(-2**70, 2**70).map(str)))
@example(option="--gpu-memory", value="nan")  # passed, and failed later with a generic exit 1
@example(option="--gpu-memory", value="inf")
@example(option="--gpu-memory", value="1e400")
@example(option="--chunk-tokens", value="0")
def test_numeric_options(option, value):
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            args = prefill.parse_args(["--model", "m", f"{option}={value}"])
        except SystemExit as e:
            assert e.code == 2
            assert stderr.getvalue().count("\n") == 1 and option in stderr.getvalue(), stderr.getvalue()
            return
    parsed = getattr(args, option[2:].replace("-", "_"))
    assert math.isfinite(parsed) and (0 <= parsed <= 2**20 if option == "--gpu-memory" else 1 <= parsed < 2**31)
