"""lm-evaluation-harness model for every registered family: `--model gpn_scale`.

    lm_eval run --model gpn_scale --model_args checkpoint=runs/x,device=cpu --tasks lambada_openai
    gpn-scale eval runs/x --lm-eval lambada_openai,hellaswag

model_args: checkpoint (a step dir, checkpoint root, run dir or model_final.pt: run/sources.py),
config (a model config name / YAML instead of the saved one), tokenizer ("byte" or a
tokenizer.json instead of the training data's), device, batch_size, max_gen_toks.

The harness's three request kinds, all from the carried state:
  - loglikelihood: each distinct context runs once, all its continuations (a multiple-choice
    question's answers) are scored from its state (eval/scoring.py);
  - loglikelihood_rolling: the whole text from the initial state, the state carried across
    2048-token chunks: no window, nothing re-scored (a recurrent model has no context limit);
  - generate_until: eval/generate.py, stopping at the `until` strings and at EOD.
Empty contexts start from the initial state (the alignment rule scores position 0 from it),
where a Hugging Face model would be given a BOS/EOS token.

The harness has no plugin discovery of its own (lm_eval 0.4.13 finds models only in its
registry), so importing this module registers the class, and `gpn_scale_lm_eval.pth`
(installed beside the package) registers it lazily whenever lm_eval's model registry is
imported: see gpn_scale/eval/lm_eval_hook.py.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from typing import Any

import lm_eval.models  # noqa: F401 - the harness registers its own models only while its
from lm_eval.api.model import LM  # registry is empty: let it do so before ours lands in it
from lm_eval.api.registry import register_model

from gpn_scale.data.tokenizer import Tokenizer
from gpn_scale.eval.generate import Sampling, generate
from gpn_scale.eval.scoring import rolling_logprob, score_continuations

MODEL_NAME = "gpn_scale"
DEFAULT_BATCH = 16


def _as_int(value: Any, default: int) -> int:
    if value is None or value == "auto" or (isinstance(value, str) and value.startswith("auto")):
        return default
    return int(value)


@register_model(MODEL_NAME)
class GPNScaleLM(LM):
    """A gpn_scale checkpoint (any family) as an lm_eval LM."""

    def __init__(
        self,
        checkpoint: str | None = None,
        config: str | None = None,
        tokenizer: str | None = None,
        device: str | None = "auto",
        batch_size: int | str | None = DEFAULT_BATCH,
        max_gen_toks: int = 256,
        max_batch_size: int | None = None,
        *,
        model: Any = None,
        tok: Tokenizer | None = None,
        **unused: Any,
    ) -> None:
        super().__init__()
        import torch

        if device and str(device).startswith("cuda") and not torch.cuda.is_available():
            print(f"gpn_scale: device {device} is not available here; using cpu", file=sys.stderr)
            device = "cpu"
        if model is None:
            if not checkpoint:
                raise ValueError("gpn_scale: pass --model_args checkpoint=PATH")
            from gpn_scale.eval.load import describe_loaded, load

            loaded = load(
                str(checkpoint), device=device or "auto", tokenizer=tokenizer, model_config=config
            )
            print(f"gpn_scale: {describe_loaded(loaded)}", file=sys.stderr, flush=True)
            model, tok, dev = loaded.model, loaded.tokenizer, loaded.device
            self.checkpoint = loaded.checkpoint
        else:
            assert tok is not None, "a model needs its tokenizer"
            dev = torch.device(device if device not in (None, "auto") else "cpu")
            self.checkpoint = checkpoint or ""
        self.model, self.tok, self._device = model, tok, dev
        self.batch_size = max(1, _as_int(batch_size, DEFAULT_BATCH))
        self.max_gen_toks = int(max_gen_toks)

    @classmethod
    def create_from_arg_string(
        cls, arg_string: str, additional_config: dict[str, Any] | None = None
    ) -> GPNScaleLM:
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(
        cls, arg_dict: dict[str, Any], additional_config: dict[str, Any] | None = None
    ) -> GPNScaleLM:
        """model_args win over the harness's own flags (its --device defaults to cuda:0)."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
        return cls(**{**extra, **arg_dict})

    @property
    def tokenizer_name(self) -> str:
        return f"{self.tok.kind}:{self.tok.name}"

    # ------------------------------------------------------------------ encoding
    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """As the harness's causal models do: trailing spaces of the context go to the
        continuation; the continuation is what encoding both adds after the context."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        if not context:
            return [], self.tok.encode(continuation)
        ctx = self.tok.encode(context)
        whole = self.tok.encode(context + continuation)
        if whole[: len(ctx)] == ctx:
            return ctx, whole[len(ctx) :]
        return ctx, self.tok.encode(continuation)

    # ------------------------------------------------------------------ requests
    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[Any]:
        pairs = [self._encode_pair(*req.args) for req in requests]
        scorable = [i for i, (_, cont) in enumerate(pairs) if cont]
        scores = score_continuations(
            self.model,
            [pairs[i] for i in scorable],
            batch_size=self.batch_size,
            device=self._device,
        )
        out: list[tuple[float, bool]] = [(0.0, True)] * len(requests)  # empty = certain
        for i, score in zip(scorable, scores):
            out[i] = (score.total, score.greedy)
            self.cache_hook.add_partial("loglikelihood", requests[i].args, out[i])
        return out

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[Any]:
        out = []
        for req in requests:
            (text,) = req.args
            value = rolling_logprob(self.model, self.tok.encode(text), device=self._device)
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, value)
            out.append(value)
        return out

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        groups: dict[str, list[int]] = defaultdict(list)
        kwargs_of: dict[str, dict[str, Any]] = {}
        for i, req in enumerate(requests):
            kwargs = dict(req.args[1]) if len(req.args) > 1 and req.args[1] else {}
            key = repr(sorted(kwargs.items()))
            groups[key].append(i)
            kwargs_of[key] = kwargs
        out = [""] * len(requests)
        for key, members in groups.items():
            sampling = self._sampling(kwargs_of[key])
            prompts = [self.tok.encode(requests[i].args[0]) for i in members]
            gens = generate(
                self.model,
                prompts,
                sampling,
                decode=self.tok.decode,
                batch_size=self.batch_size,
                device=self._device,
            )
            for i, g in zip(members, gens):
                out[i] = g.text
                self.cache_hook.add_partial("generate_until", requests[i].args, g.text)
        return out

    def _sampling(self, kwargs: dict[str, Any]) -> Sampling:
        until = kwargs.get("until") or []
        stops = tuple(s for s in ([until] if isinstance(until, str) else until) if s)
        do_sample = bool(kwargs.get("do_sample", False))
        temperature = float(kwargs.get("temperature", 0.0 if not do_sample else 1.0))
        return Sampling(
            max_new_tokens=int(kwargs.get("max_gen_toks", self.max_gen_toks)),
            temperature=temperature if do_sample or temperature > 0 else 0.0,
            top_k=int(kwargs.get("top_k") or 0),
            top_p=float(kwargs.get("top_p") or 1.0),
            seed=int(kwargs.get("seed") or 0),
            stop_tokens=frozenset({self.tok.eod_token_id}),
            stop_strings=stops,
            vocab_limit=self.tok.vocab_size,  # padded vocabulary ids are never generated
        )
