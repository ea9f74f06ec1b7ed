# Shared fixtures for the test suite (the runner's tests use them too).

import copy
import dataclasses
import os
import threading

# Under pytest-xdist each worker takes its share of the cores for torch's threads (set before torch is imported, and
# inherited by the prefill.py, torchrun and lm-eval processes the tests start, so that a test's in-process numbers and
# its subprocesses' run alike): two workers of two threads each on two cores made every torch op contend.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

import pytest  # noqa: E402
import torch  # noqa: E402

import interact
import prefill


@pytest.fixture(scope="session")
def qwen_tokenizer_dir():
    """The real Qwen3 tokenizer files (tokenizer.json, tokenizer_config.json with the chat template, ...)."""
    return interact.qwen_tokenizer_dir()


@pytest.fixture(scope="session")
def qwen_tokenizer(qwen_tokenizer_dir):
    return interact.load_tokenizer(qwen_tokenizer_dir)


@pytest.fixture(scope="session")
def gqa_checkpoint(tmp_path_factory, qwen_tokenizer_dir):
    """(folder, transformers' float32 losses of test_prefill's TEXTS): the tiny sharded GQA Qwen3 checkpoint that
    test_prefill and test_dist run, built once per session."""
    from test_prefill import checkpoint_with_reference
    return checkpoint_with_reference(tmp_path_factory, qwen_tokenizer_dir, "gqa", sharded=True)


@pytest.fixture(scope="session")
def fp8_folder(tmp_path_factory, qwen_tokenizer_dir):
    """test_fp8's tiny block-wise FP8 Qwen3 (3 layers, hidden 256, tied), which test_dist runs too."""
    from test_fp8 import write_fp8_checkpoint
    return write_fp8_checkpoint(tmp_path_factory.mktemp("fp8"), qwen_tokenizer_dir)


# ----------------------------------------------------------------------------- the start-up attention check, once
# Every Runner checks its attention backend against float32 attention on texts of up to 4500 tokens (pick_attention,
# and pick_tree_attention at its first prefix tree): 2-3 s a Runner on two idle CPU cores, and the suite makes dozens
# of Runners of the same few geometries. The check is a pure function of its arguments and of the code it runs, so a
# result is reused only for the same arguments (SDPA on the CPU: what every in-process Runner asks for) and the same
# code: prefill's globals and torch's functions, each the very object it was when the result was computed. A test
# that patches any of them (a planted bug, shorter check lengths, a leaking tril) gets a check of its own, run for
# real; a refusal (an exception) is never kept. (An object changed in place is not seen: none that SDPA's check
# reads is changed so by any test.)

def code_state():
    state = []
    for space in (vars(prefill), vars(torch), vars(torch.Tensor), vars(torch.nn.functional)):
        state.append({name: (id(value), repr(value) if isinstance(value, (list, dict, set)) else None)
                      for name, value in list(space.items())})
    return state


def memoized(pick, key_of):
    kept, lock = {}, threading.Lock()

    def cached(*args):
        key = key_of(*args)
        if key is None:
            return pick(*args)
        state = code_state()
        with lock:
            hit = kept.get(key)
        if hit is not None and hit[0] == state:
            return copy.deepcopy(hit[1])  # dicts a Runner may change; the functions themselves
        result = pick(*args)
        with lock:
            kept[key] = state, result
        return copy.deepcopy(result)
    return cached


def sdpa_on_cpu(requested, device, cfg, *picks):
    if requested == "sdpa" and torch.device(device).type == "cpu":
        # pick_attention's picks play no part for SDPA on the CPU, nor do the weights' dtypes (the checks make
        # their own activations): an FP8 checkpoint and its bf16 copy share a check
        return repr(dataclasses.replace(cfg, fp8_scales=None, fp8_not_converted=(), fp8_experts=False))
    return None


@pytest.fixture(scope="session", autouse=True)
def attention_checked_once_per_geometry():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(prefill, "pick_attention", memoized(prefill.pick_attention, sdpa_on_cpu))
        patch.setattr(prefill, "pick_tree_attention", memoized(prefill.pick_tree_attention, sdpa_on_cpu))
        yield
