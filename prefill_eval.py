#!/usr/bin/env python3
"""prefill as an lm-evaluation-harness backend: lm-eval's log-likelihood requests, scored by prefill's prefix trees.

    uv run --extra eval python prefill_eval.py --model prefill --model_args pretrained=DIR[,gpu_memory=GIB,...] \\
        --tasks mmlu,hellaswag [any other lm_eval option]
    import prefill_eval; lm_eval.simple_evaluate(model="prefill", model_args="pretrained=DIR", tasks=[...])

A thin adapter (docs/eval.md): requests are tokenized exactly as lm-eval's HF backend
tokenizes them, cut to max_length from the left as it cuts them, and handed to prefill.Runner.loglikelihoods, which
scores every request of a call as one corpus of prefix-tree waves. No scoring happens here. With --model prefill,
generate_until tasks are refused before any model loads: prefill does not generate. --help lists prefill's
model_args before lm-eval's own help.

It starts as lm-eval does with its own backends: lm-eval's CLI as it is, its task manager built once, and nothing
imported that lm-eval's start does not need: torch, transformers and prefill come with the model's first request
(the tokenizer and the config too, so that the refusal comes before anything of the checkpoint is read).
"""
import atexit
import functools
import os
import sys

import lm_eval.models  # noqa: F401 (first: the registry fills itself only while empty, and "hf" must stay in it)
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import has_bos_prefix
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

PROG = "prefill_eval.py"  # in lm-eval's usage lines, where lm-eval's CLI says "lm-eval"

GENERATIVE = "generate_until"
NOT_GENERATING = "prefill scores log-likelihoods and does not generate text"
MODEL_ARGS = """\
prefill's --model_args (with --model prefill; key=value, comma-separated):
  pretrained=DIR       the checkpoint folder (required): config.json, *.safetensors, the tokenizer files
  gpu_memory=GIB       GPU memory the runner may plan for (prefill.py --gpu-memory; 0 streams every layer)
  max_length=N         contexts are cut from the left to N tokens, as the HF backend cuts them (default: the
                       config's max_position_embeddings)
  wave_tokens=N        tokens a wave holds on the GPU (prefill.py --wave-tokens; default 65536)
  chunk_tokens=N       attention and MLP chunk (prefill.py --chunk-tokens; default 4096)
  attention=KIND       prefill.py --attention (default auto)
  kernels=KIND         auto, triton or torch (prefill.py --kernels)
  host_memory=GIB      host memory the runner may page-lock (prefill.py --host-memory)
  picks=FILE           where timed picks are kept per machine (prefill.py --picks)
  add_bos_token=BOOL   True or False, as the HF backend's (default: the tokenizer's own: a BOS for Llama 3, Gemma)
batch_size and max_batch_size are accepted and unused (waves are sized in tokens); --device cpu or cuda may choose
the device, which is otherwise prefill.py's: cuda where torch sees a GPU, else the CPU. The numbers: a bf16 network,
its logits and log-softmax in float32 (docs/eval.md). generate_until tasks are refused with --model prefill; other
models run as lm-eval runs them. lm-eval's own options follow: prefill_eval.py takes each of them, as `lm-eval` does.
"""


class Refused(Exception):
    """A run lm-eval would start that prefill cannot do (generate_until tasks): one line, exit 2."""


@register_model("prefill")
class PrefillLM(TemplateLM):
    """model_args: MODEL_ARGS above. The model loads at the first request; under torchrun each rank takes its own GPU
    and the ranks share the batches."""

    def __init__(self, pretrained=None, gpu_memory=None, max_length=None, wave_tokens=65536, chunk_tokens=4096,
                 attention="auto", kernels="auto", host_memory=None, picks=None, add_bos_token=None, batch_size=None,
                 max_batch_size=None, device=None):
        super().__init__()
        if not pretrained:
            raise ValueError("prefill needs model_args pretrained=DIR (a checkpoint folder)")
        self.pretrained = str(pretrained)
        if add_bos_token is not None and not isinstance(add_bos_token, bool):  # model_args' text, as lm-eval reads it
            add_bos_token = {"true": True, "false": False}.get(str(add_bos_token).lower())
            if add_bos_token is None:
                raise ValueError("add_bos_token must be True or False")
        self.add_bos_token, self.given_max_length = add_bos_token, max_length
        if str(device or "").split(":")[0] not in ("", "cuda", "cpu"):
            raise ValueError(f"prefill runs on cuda or cpu, not {device!r}")
        self.options = dict(device="cpu" if str(device).startswith("cpu") else None,
                            gpu_memory_gib=None if gpu_memory is None else float(gpu_memory),
                            host_memory_gib=None if host_memory is None else float(host_memory),
                            wave_tokens=int(wave_tokens), chunk_tokens=int(chunk_tokens), attention=str(attention),
                            kernels=str(kernels), picks=picks)
        self.runner, self.calls = None, 0
        self._world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if self._world_size > 1:  # lm-eval's data parallel: torchrun's ranks, one GPU each
            import torch
            import prefill_dist
            self._rank = int(os.environ["RANK"])
            # before the runtime starts, the rank's GPU alone made visible; torchrun's store, through which the ranks
            # share the batches of every call (prefill_dist.shared, as prefill.py's corpus does)
            self.group = prefill_dist.Group.from_env(self.options["device"])
            atexit.register(self.group.close)  # its heartbeat ends before the interpreter does
            if not torch.distributed.is_initialized():  # lm-eval's own gathers
                torch.distributed.init_process_group("gloo")  # CPU tensors and objects: works beside any GPU

    @functools.cached_property
    def tokenizer(self):  # the HF backend's tokenizer, so that every request's ids are the ones it would score
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(self.pretrained, trust_remote_code=False, **(
            {} if self.add_bos_token is None else {"add_bos_token": self.add_bos_token}))

    @property
    def eot_token_id(self):
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self):  # as the HF backend: BOS, else EOS (Qwen3 has no BOS)
        bos = self.tokenizer.bos_token_id
        return self.eot_token_id if bos is None else bos

    @functools.cached_property
    def max_length(self):
        if self.given_max_length:
            return int(self.given_max_length)
        from lm_eval.models.utils import resolve_max_length
        from transformers import AutoConfig
        return resolve_max_length(AutoConfig.from_pretrained(self.pretrained, trust_remote_code=False), self.tokenizer)

    @property
    def device(self):  # where lm-eval puts the request counts it gathers: gloo gathers CPU tensors
        import torch
        return torch.device("cpu")

    def tok_encode(self, string, add_special_tokens=None, **kwargs):
        # the HF backend's tok_encode: the tokenizer's own default (Llama 3 and Gemma add a BOS, Qwen nothing) unless
        # add_special_tokens or model_args' add_bos_token says otherwise; a string that starts with the BOS (its
        # prefix_token_id's text) itself gets none added
        given = add_special_tokens if add_special_tokens is not None else self.add_bos_token
        special = {} if given is None else {"add_special_tokens": given}
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            special["add_special_tokens"] = False
        return self.tokenizer.encode(string, **special)

    def _runner(self):
        if self.runner is None:
            import prefill
            self.runner = prefill.Runner(self.pretrained, **self.options)
        return self.runner

    def _loglikelihood_tokens(self, requests, disable_tqdm=False, **kwargs):
        """((context, continuation), context ids, continuation ids) each -> (log-likelihood, is_greedy), in order.
        As the HF backend: the continuation is scored whole, the context cut from the left so that the model reads
        at most max_length tokens."""
        pairs = []
        for _, context, continuation in requests:
            if len(continuation) > self.max_length:
                raise ValueError(f"a continuation of {len(continuation)} tokens exceeds max_length {self.max_length}")
            tokens = (context + continuation)[-(self.max_length + 1):]
            pairs.append((tokens[:len(tokens) - len(continuation)], continuation))
        results = self._scored(pairs, disable_tqdm)
        answers = [(r.logprob, r.greedy) for r in results]
        for (strings, _, _), answer in zip(requests, answers):
            if strings is not None:
                self.cache_hook.add_partial("loglikelihood", strings, answer)
        return answers

    def _scored(self, pairs, disable_tqdm):
        # every rank's requests are scored as one corpus, its batches shared among the ranks (prefill_dist.shared),
        # so that every batch, and with it every number, is the one process's (lm-eval shards the documents per rank)
        import prefill
        import prefill_dist
        import torch
        runner = self._runner()
        everyone, scored = [pairs], None
        if self.world_size > 1:
            everyone = [None] * self.world_size
            torch.distributed.all_gather_object(everyone, pairs)
            self.calls += 1
            tag = f"eval/{self.calls}/"  # each call's own keys in the store
            scored = lambda batches: prefill_dist.shared(  # noqa: E731
                self.group, batches, runner.score_requests, prefill_dist.publish_loglikelihoods,
                prefill_dist.receive_loglikelihoods, tag=tag)
        flat = [pair for part in everyone for pair in part]
        progress = prefill.Progress(len(flat), unit="request") if self.rank == 0 and not disable_tqdm else None
        try:
            results = runner.loglikelihoods(flat, progress=progress, scored=scored)
        finally:
            if progress is not None:
                progress.close()
        start = sum(len(part) for part in everyone[:self.rank])
        return results[start:start + len(pairs)]

    def loglikelihood_rolling(self, requests, disable_tqdm=False):
        """One float per document: the sum over the HF backend's disjoint windows (max_length tokens each, the first
        predicted from prefix_token_id), all documents' windows scored as one corpus."""
        windows, owners = [], []
        for i, (string,) in enumerate(request.args for request in requests):
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, continuation))
                owners.append(i)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm)):
            totals[owner] += logprob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm=False):
        raise NotImplementedError(f"{NOT_GENERATING}: generate_until tasks cannot run on it")

    # lm-eval's data parallel (its evaluator calls these), through torch.distributed
    def all_gather(self, tensor):
        if self.world_size == 1:
            return tensor
        import torch
        parts = [torch.zeros_like(tensor) for _ in range(self.world_size)]
        torch.distributed.all_gather(parts, tensor)
        return torch.stack(parts) if tensor.dim() == 0 else torch.cat(parts)

    def gather_object(self, obj, dst=0):
        if self.world_size == 1:
            return [obj]
        import torch
        gathered = [None] * self.world_size if self.rank == dst else None
        torch.distributed.gather_object(obj, gathered, dst=dst)
        return gathered

    def barrier(self):
        if self.world_size > 1:
            import torch
            torch.distributed.barrier()


def refusing_generation(evaluate):
    """lm-eval's evaluate(lm, task_dict, ...), which first refuses the generate_until tasks of a run of prefill's, before
    any request is built: the model loads at the first request. It gets the tasks lm-eval's CLI resolved (names,
    groups, tags, YAML paths) with the one task manager it built; another model generates as lm-eval has it."""
    @functools.wraps(evaluate)
    def evaluating(lm, task_dict, *args, **kwargs):
        if isinstance(getattr(lm, "lm", lm), PrefillLM):  # lm-eval's CachingLM holds the model as .lm
            refused = sorted(name for name, task in task_dict["tasks"].items() if task.OUTPUT_TYPE == GENERATIVE)
            if refused:
                raise Refused(f"{NOT_GENERATING}; these tasks are generate_until: {', '.join(refused)}")
        return evaluate(lm, task_dict, *args, **kwargs)
    return evaluating


def main(argv=None):
    from lm_eval._cli.harness import HarnessCLI
    from lm_eval.utils import setup_logging
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:  # prefill's model_args, then lm-eval's own help (which exits)
        print(MODEL_ARGS, flush=True)
    setup_logging()  # what lm-eval's cli_evaluate does, under this script's name
    cli = HarnessCLI()
    for parser in [getattr(cli, "_parser", None), *getattr(getattr(cli, "_subparsers", None), "choices", {}).values()]:
        if parser is not None:
            parser.prog = parser.prog.replace("lm-eval", PROG, 1)
    sys.argv = [sys.argv[0], *argv]
    args = cli.parse_args()
    if getattr(args, "command", None) == "run":  # the evaluator, as lm-eval's run imports it
        import lm_eval.evaluator
        lm_eval.evaluator.evaluate = refusing_generation(lm_eval.evaluator.evaluate)
    try:
        cli.execute(args)
    except Exception as e:  # a UserError comes from the model, and so only after prefill is imported
        prefill = sys.modules.get("prefill")
        if not isinstance(e, Refused) and not (prefill and isinstance(e, prefill.UserError)):
            raise
        print(f"prefill_eval: error: {prefill.one_line(str(e)) if prefill else e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
