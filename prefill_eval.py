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
"""
import atexit
import os
import sys

import lm_eval.models  # noqa: F401 (first: the registry fills itself only while empty, and "hf" must stay in it)
import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import has_bos_prefix
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

import prefill
import prefill_dist

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
batch_size and max_batch_size are accepted and unused (waves are sized in tokens); pass --device cpu or cuda on the
command line. The numbers: a bf16 network, its logits and log-softmax in float32 (docs/eval.md). generate_until tasks
are refused with --model prefill; other models run as lm-eval runs them.
"""


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
        from transformers import AutoConfig, AutoTokenizer
        from lm_eval.models.utils import resolve_max_length
        self.pretrained = str(pretrained)
        # the HF backend's tokenizer, so that every request's ids are the ones it would score
        if add_bos_token is not None and not isinstance(add_bos_token, bool):  # model_args' text, as lm-eval reads it
            add_bos_token = {"true": True, "false": False}.get(str(add_bos_token).lower())
            if add_bos_token is None:
                raise ValueError("add_bos_token must be True or False")
        self.add_bos_token = add_bos_token
        self.tokenizer = AutoTokenizer.from_pretrained(self.pretrained, trust_remote_code=False, **(
            {} if add_bos_token is None else {"add_bos_token": add_bos_token}))
        self._max_length = int(max_length) if max_length else resolve_max_length(
            AutoConfig.from_pretrained(self.pretrained, trust_remote_code=False), self.tokenizer)
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
            self._rank = int(os.environ["RANK"])
            # before the runtime starts, the rank's GPU alone made visible; torchrun's store, through which the ranks
            # share the batches of every call (prefill_dist.shared, as prefill.py's corpus does)
            self.group = prefill_dist.Group.from_env(self.options["device"])
            atexit.register(self.group.close)  # its heartbeat ends before the interpreter does
            if not torch.distributed.is_initialized():  # lm-eval's own gathers
                torch.distributed.init_process_group("gloo")  # CPU tensors and objects: works beside any GPU

    @property
    def eot_token_id(self):
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self):  # as the HF backend: BOS, else EOS (Qwen3 has no BOS)
        bos = self.tokenizer.bos_token_id
        return self.eot_token_id if bos is None else bos

    @property
    def max_length(self):
        return self._max_length

    @property
    def device(self):  # where lm-eval puts the request counts it gathers: gloo gathers CPU tensors
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
        parts = [torch.zeros_like(tensor) for _ in range(self.world_size)]
        torch.distributed.all_gather(parts, tensor)
        return torch.stack(parts) if tensor.dim() == 0 else torch.cat(parts)

    def gather_object(self, obj, dst=0):
        if self.world_size == 1:
            return [obj]
        gathered = [None] * self.world_size if self.rank == dst else None
        torch.distributed.gather_object(obj, gathered, dst=dst)
        return gathered

    def barrier(self):
        if self.world_size > 1:
            torch.distributed.barrier()


def generative_tasks(argv):
    """The tasks of an lm_eval command line (argv, without the program) for --model prefill whose output type is
    generate_until, found with lm-eval's own parser and TaskManager, as its CLI resolves them (names, groups, tags,
    YAML paths); none for another model, which generates as lm-eval has it."""
    from lm_eval._cli.harness import HarnessCLI
    from lm_eval.config.evaluate_config import EvaluatorConfig
    saved = sys.argv
    sys.argv = [saved[0], *argv]
    try:
        args = HarnessCLI().parse_args()
    finally:
        sys.argv = saved
    if getattr(args, "command", None) != "run" or not getattr(args, "tasks", None) or args.model != "prefill":
        return []  # ls, validate, --help, another model: nothing of prefill's runs
    cfg = EvaluatorConfig.from_cli(args)
    tasks = cfg.process_tasks(cfg.metadata).load(cfg.tasks)["tasks"]
    return sorted(name for name, task in tasks.items() if task.OUTPUT_TYPE == GENERATIVE)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:  # prefill's model_args, then lm-eval's own help (which exits)
        print(MODEL_ARGS, flush=True)
    refused = generative_tasks(argv)
    if refused:
        print(f"prefill_eval: error: {NOT_GENERATING}; these tasks are generate_until: {', '.join(refused)}",
              file=sys.stderr)
        return 2
    from lm_eval.__main__ import cli_evaluate
    sys.argv = [sys.argv[0], *argv]
    try:
        cli_evaluate()
    except prefill.UserError as e:
        print(f"prefill_eval: error: {prefill.one_line(str(e))}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
