"""`gpn-scale generate` and the task side of `gpn-scale eval CHECKPOINT --task / --lm-eval`
(`eval` is registered by app/commands.py, whose held-out side is the trainer's; it hands
--task / --lm-eval over to `cmd_task_eval`).

Exit codes: 0 done; 2 bad input (one line on stderr naming the flag or file and the fix).
A result file is never replaced unless --overwrite says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from gpn_scale.core.config import ConfigError, closest_key_hint
from gpn_scale.core.hardware import pick_device  # torch-free at import
from gpn_scale.run.sources import resolve

TASKS = ("lambada",)
DEFAULT_BATCH = 16
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT), as shells report it


def register(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser(
        "generate",
        help="sample from a checkpoint (any family), decoding with the carried state",
        description="Continue each --prompt with the checkpoint's model: the prompt runs "
        "once, then one step per new token from the carried state. Prompts are batched "
        "with prompts of the same token length. Writes nothing. Exit codes: 0 done, 2 bad "
        "input (one line on stderr).",
    )
    g.add_argument(
        "checkpoint", help="a step directory, checkpoint root, run dir or model_final.pt"
    )
    g.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for a batch)")
    g.add_argument("--prompt-file", default=None, help="a text file with one prompt a line")
    g.add_argument(
        "--max-new-tokens", type=int, default=64, help="per prompt, at most (default %(default)s)"
    )
    g.add_argument(
        "--temperature", type=float, default=1.0, help="0 = greedy (default %(default)s)"
    )
    g.add_argument("--top-k", type=int, default=0, help="0 = off (default %(default)s)")
    g.add_argument("--top-p", type=float, default=1.0, help="1 = off (default %(default)s)")
    g.add_argument(
        "--seed", type=int, default=0, help="prompt i samples with seed+i (default %(default)s)"
    )
    g.add_argument(
        "--stop", action="append", default=[], help="stop string (repeatable; cut from the text)"
    )
    g.add_argument(
        "--stop-token",
        action="append",
        type=int,
        default=[],
        help="stop token id (repeatable; the tokenizer's end-of-document always stops)",
    )
    add_model_flags(g)
    g.add_argument(
        "--json", action="store_true", help="print one JSON list (prompt, text, tokens, stopped)"
    )
    g.set_defaults(func=cmd_generate)

    x = sub.add_parser(
        "export",
        help="a checkpoint as safetensors + config.json + tokenizer (or a Hugging Face Llama)",
        description="Write any checkpoint (a step directory local or s3:// of any dp/tp "
        "layout, a checkpoint root or run dir: its newest checkpoint; a model_final.pt) as "
        "model.safetensors + config.json + tokenizer.json in --out, loadable by eval / "
        "generate / analyze; --format hf writes a Transformer++ checkpoint as a Hugging Face "
        "LlamaForCausalLM. Exit codes: 0 done, 2 bad input (one line on stderr, nothing "
        "written).",
    )
    x.add_argument("checkpoint", help="a step directory, checkpoint root, run dir or .pt")
    x.add_argument("--out", required=True, help="the export directory (new or empty)")
    x.add_argument(
        "--format",
        default="safetensors",
        choices=("safetensors", "hf"),
        help="safetensors (ours, every family) or hf (Transformer++ as Llama); default %(default)s",
    )
    x.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16", "float16"),
        help="the weights' dtype (default %(default)s: the checkpoint's fp32 master weights)",
    )
    x.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    x.add_argument(
        "--tokenizer",
        default=None,
        help="the tokenizer.json if it moved (must be the recorded tokenizer)",
    )
    x.set_defaults(func=cmd_export)


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """The flags every checkpoint-reading command shares (eval/load.py, run/sources.py)."""
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default auto)")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="'byte' or a tokenizer.json (default: the training data's, from its metadata)",
    )
    p.add_argument(
        "--model-config",
        default=None,
        help="a model config name / YAML (default: the one saved with the checkpoint)",
    )
    p.add_argument(
        "--batch-size", type=int, default=None, help="sequences per forward (default 16)"
    )


def add_task_flags(p: argparse.ArgumentParser) -> None:
    """`gpn-scale eval CHECKPOINT --task ... | --lm-eval ...` (registered by app/commands)."""
    p.add_argument(
        "--task", default=None, help=f"a built-in task on CHECKPOINT: {', '.join(TASKS)}"
    )
    p.add_argument(
        "--data",
        default=None,
        help="--task data: a JSONL file ({'text': ...} a line) or hf:NAME[:CONFIG] "
        "(the `datasets` library, split test)",
    )
    p.add_argument(
        "--lm-eval",
        default=None,
        metavar="TASKS",
        help="lm-evaluation-harness tasks on CHECKPOINT, comma-separated",
    )
    p.add_argument(
        "--include-path", default=None, help="--lm-eval: a directory of extra task YAMLs"
    )
    p.add_argument("--num-fewshot", type=int, default=None, help="--lm-eval: few-shot examples")
    p.add_argument("--limit", type=int, default=None, help="score only the first N examples")
    p.add_argument(
        "--out",
        default=None,
        help="the result JSON (default: beside the checkpoint, "
        "step_N.<task>.json / model_final.<task>.json)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing result file")


def _fail(err: BaseException | str) -> int:
    msg = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    from gpn_scale.io.storage import redact_urls  # no endpoint password in a line

    print(f"gpn-scale: error: {redact_urls(msg)}", file=sys.stderr, flush=True)
    return 2


def _errors() -> tuple[type[BaseException], ...]:
    from gpn_scale.data import DataError

    return (ConfigError, DataError)


def _check_positive(name: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise ConfigError(f"{name} {value}: must be >= 1")


# ------------------------------------------------------------------------------ results
def default_result_uri(checkpoint: str, task: str) -> str:
    """`<root>/step_N.<task>.json` for a step dir, `<dir>/model_final.<task>.json`."""
    base = checkpoint.rstrip("/")
    if base.endswith(".pt"):
        base = base[: -len(".pt")]
    return f"{base}.{task}.json"


def _split(uri: str) -> tuple[Any, str]:
    from gpn_scale.io.storage import open_storage

    parent, _, name = uri.rstrip("/").rpartition("/")
    return open_storage(parent or ".", error=ConfigError, subject="result directory"), name


def check_writable(uri: str, overwrite: bool) -> None:
    """Before any work: refuse to replace a result unless asked."""
    storage, name = _split(uri)
    if storage.exists(name) and not overwrite:
        raise ConfigError(f"{uri} exists; pass --overwrite to replace it, or --out another file")
    if "://" not in uri:  # a read-only run (or mount) fails here, not after the work
        import os

        from gpn_scale.io.storage import writable_dir

        parent = os.path.dirname(os.path.abspath(uri))
        probe = parent
        while not os.path.exists(probe) and os.path.dirname(probe) != probe:
            probe = os.path.dirname(probe)
        if os.path.isdir(probe) and not writable_dir(probe):
            raise ConfigError(
                f"{uri}: {probe} is not writable (a read-only run?); pass --out FILE elsewhere"
            )


def write_result(uri: str, result: dict[str, Any]) -> None:
    storage, name = _split(uri)
    storage.put_bytes(name, (json.dumps(result, indent=1, default=str) + "\n").encode())


def _header(loaded: Any, task: str) -> dict[str, Any]:
    return {
        "task": task,
        "checkpoint": loaded.checkpoint,
        "step": loaded.step,
        "family": loaded.spec.name,
        "model": loaded.name,
        "parameters": sum(p.numel() for p in loaded.model.parameters()),
        "tokenizer": loaded.tokenizer.identity(),
        "device": str(loaded.device),
        "created_unix": time.time(),
    }


# ------------------------------------------------------------------------------ eval
def cmd_task_eval(args: argparse.Namespace) -> int:
    """`gpn-scale eval CHECKPOINT --task lambada --data PATH` / `--lm-eval TASKS`."""
    try:
        return _task_eval(args)
    except _errors() as err:
        return _fail(err)


def _task_flags(args: argparse.Namespace) -> list[str]:
    """The flags of a --task / --lm-eval run checked (one-line ConfigError each); the
    harness's task names (empty for --task)."""
    if args.overrides:
        raise ConfigError(
            f"{args.overrides[0]}: --task / --lm-eval take a CHECKPOINT and flags only "
            "(key=value overrides are for the held-out eval of a training config)"
        )
    if args.task and args.lm_eval:
        raise ConfigError("--task and --lm-eval: pick one per run")
    if args.task and args.task not in TASKS:
        raise ConfigError(
            f"--task {args.task}: unknown task{closest_key_hint(args.task, TASKS)}; "
            f"expected one of {', '.join(TASKS)} (or --lm-eval TASKS for the harness)"
        )
    if args.task and not args.data:
        raise ConfigError(f"--task {args.task} needs --data PATH.jsonl or --data hf:NAME")
    _check_positive("--batch-size", args.batch_size)
    _check_positive("--limit", args.limit)
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise ConfigError(f"--num-fewshot {args.num_fewshot}: must be >= 0")
    tasks = [t.strip() for t in (args.lm_eval or "").split(",") if t.strip()]
    if args.lm_eval is not None and not tasks:
        raise ConfigError("--lm-eval: name at least one task, e.g. --lm-eval lambada_openai")
    return tasks


def _task_eval(args: argparse.Namespace) -> int:
    from gpn_scale.eval.load import describe_loaded, load

    tasks = _task_flags(args)
    name = args.task or "lm_eval." + "+".join(tasks)
    pick_device(args.device)  # a bad --device fails before anything loads
    args.batch_size = args.batch_size or DEFAULT_BATCH
    _, ckpt = resolve(args.config)
    texts = None
    if args.task == "lambada":
        from gpn_scale.eval.lambada import read_texts

        texts = read_texts(args.data, args.limit)  # bad data fails before the model loads
    elif tasks:
        _check_lm_eval(tasks, args.include_path)
    out = args.out or default_result_uri(ckpt, name)
    check_writable(out, args.overwrite)
    loaded = load(
        args.config, device=args.device, tokenizer=args.tokenizer, model_config=args.model_config
    )
    if loaded.checkpoint != ckpt:  # a live run saved (or its retention deleted) meanwhile
        ckpt = loaded.checkpoint
        out = args.out or default_result_uri(ckpt, name)
        check_writable(out, args.overwrite)
    # stdout holds the result line alone (or the JSON); which weights went to stderr.
    print(f"eval: {name}: {describe_loaded(loaded)}", file=sys.stderr, flush=True)
    result = _header(loaded, name)
    if texts is not None:
        from gpn_scale.eval.lambada import evaluate_lambada

        metrics = evaluate_lambada(
            loaded.model,
            loaded.tokenizer,
            texts,
            batch_size=args.batch_size,
            device=loaded.device,
        )
        result.update(data=args.data, metrics=metrics)
        line = (
            f"lambada: accuracy {metrics['accuracy']:.4f}, ppl {metrics['ppl']:.2f} over "
            f"{metrics['examples']:,} passages"
        )
    else:
        result.update(_run_lm_eval(loaded, args, tasks))
        line = "lm-eval: " + "; ".join(
            f"{task} "
            + ", ".join(
                f"{k.split(',')[0]} {v:.4f}"
                for k, v in metrics.items()
                if isinstance(v, float) and "stderr" not in k
            )
            for task, metrics in result["results"].items()
        )
    write_result(out, result)
    result["result_file"] = out
    if args.json:
        print(json.dumps(result, default=str))
    else:
        step = f" (step {loaded.step})" if loaded.step is not None else ""
        print(f"{line}{step} -> {out}")
    return 0


_TRUE = ("1", "true", "yes", "on")


def _hub_offline() -> str | None:
    """Why the Hugging Face Hub cannot be reached from here (None: it answers, or offline
    mode is already set). A 3 s probe: the harness's own retries take over a minute per task
    before failing in a traceback."""
    import urllib.error
    import urllib.request

    if any(
        os.environ.get(k, "").lower() in _TRUE for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    ):
        return None
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    try:
        urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=3)
    except urllib.error.HTTPError:
        return None  # it answered
    except (urllib.error.URLError, OSError, ValueError) as err:
        reason = getattr(err, "reason", err)
        return f"{endpoint} is not reachable ({reason})"
    return None


def _go_offline() -> None:
    """Cache-only from now on: datasets and huggingface_hub read these at import, and are
    patched as well where already imported."""
    os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
    for module, name in (("datasets.config", "HF_HUB_OFFLINE"),
                         ("huggingface_hub.constants", "HF_HUB_OFFLINE")):  # fmt: skip
        mod = sys.modules.get(module)
        if mod is not None and hasattr(mod, name):
            setattr(mod, name, True)


def _load_task_data(tasks: list[str], manager: Any, offline: str | None) -> None:
    """Build the tasks (which fetches their data) before the model loads: a task whose data
    cannot be had fails here in one line."""
    import logging

    from lm_eval.tasks import get_task_dict

    quiet = [logging.getLogger(n) for n in ("lm_eval", "datasets", "huggingface_hub")]
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.ERROR)
    try:
        get_task_dict(tasks, manager)
    except Exception as err:  # noqa: BLE001 - offline, gated, a bad task YAML: one line
        first = " ".join(str(err).split())[:300] or type(err).__name__
        where = (
            f"{offline} and the data is not in the local cache "
            f"(HF_HOME={os.environ.get('HF_HOME', '~/.cache/huggingface')}); fetch it once "
            "with the same HF_HOME on a machine with internet, or use --include-path DIR for "
            "a task with local data"
            if offline
            else "check the task and the network (or set HF_DATASETS_OFFLINE=1 with a warm cache)"
        )
        raise ConfigError(
            f"--lm-eval {','.join(tasks)}: the task data could not be loaded "
            f"({type(err).__name__}: {first}); {where}"
        ) from None
    finally:
        for q, level in zip(quiet, levels):
            q.setLevel(level)


def _hf_cache_is_empty() -> str | None:
    """The Hugging Face caches (hub downloads, datasets) when they hold nothing, else None."""
    home = Path(os.path.expanduser(os.environ.get("HF_HOME", "~/.cache/huggingface")))
    dirs = [
        Path(os.path.expanduser(os.environ.get("HF_HUB_CACHE", str(home / "hub")))),
        Path(os.path.expanduser(os.environ.get("HF_DATASETS_CACHE", str(home / "datasets")))),
    ]
    if any(d.is_dir() and any(d.iterdir()) for d in dirs):
        return None
    return " and ".join(str(d) for d in dirs)


@functools.cache
def _task_manager(include_path: str | None) -> Any:
    """lm-eval's task index (it reads every task YAML: tens of seconds), built once."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path)


def _check_lm_eval(tasks: list[str], include_path: str | None) -> None:
    offline = _hub_offline()
    if offline:  # before lm_eval imports datasets: cache-only, fast
        _go_offline()
        empty = _hf_cache_is_empty() if include_path is None else None
        if empty:  # no stock task can load: say so now, not after indexing every task
            raise ConfigError(
                f"--lm-eval {','.join(tasks)}: the task data comes from the Hugging Face Hub, "
                f"but {offline} and the local cache is empty ({empty}); fetch the data once "
                "with the same HF_HOME on a machine with internet, or use --include-path DIR "
                "for a task with local data"
            )
    try:
        from lm_eval.tasks import TaskManager  # noqa: F401 - is the harness installed?
    except ImportError:
        raise ConfigError(
            "--lm-eval: lm-evaluation-harness is not installed; pip install 'gpn_scale[eval]'"
        ) from None
    import os

    if include_path is not None and not os.path.isdir(include_path):
        raise ConfigError(f"--include-path {include_path}: not a directory")
    manager = _task_manager(include_path)
    known = set(manager.all_tasks)
    for task in tasks:
        if task not in known:
            raise ConfigError(
                f"--lm-eval {task}: unknown lm-eval task{closest_key_hint(task, sorted(known))}"
                "; list them with `lm_eval ls tasks` (or --include-path DIR for your own)"
            )
    _load_task_data(tasks, manager, offline)


def _run_lm_eval(loaded: Any, args: argparse.Namespace, tasks: list[str]) -> dict[str, Any]:
    from lm_eval import simple_evaluate

    from gpn_scale.eval.lm_eval_adapter import GPNScaleLM

    lm = GPNScaleLM(
        checkpoint=loaded.checkpoint,
        model=loaded.model,
        tok=loaded.tokenizer,
        device=str(loaded.device),
        batch_size=args.batch_size,
    )
    out = simple_evaluate(
        model=lm,
        tasks=tasks,
        num_fewshot=args.num_fewshot,
        limit=args.limit,
        task_manager=_task_manager(args.include_path),
        log_samples=False,
    )
    if out is None:  # non-zero ranks; we run one process
        raise ConfigError("lm-eval returned no results")
    return {
        "tasks": tasks,
        "results": out.get("results", {}),
        "versions": out.get("versions", {}),
        "n-shot": out.get("n-shot", {}),
        "lm_eval": {"num_fewshot": args.num_fewshot, "limit": args.limit},
    }


# ------------------------------------------------------------------------------ generate
def cmd_generate(args: argparse.Namespace) -> int:
    try:
        return _generate(args)
    except _errors() as err:
        return _fail(err)
    except KeyboardInterrupt:  # before decoding (loading the checkpoint): nothing to show
        print("gpn-scale: generate interrupted by Ctrl-C", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED


def _generate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from gpn_scale.eval.generate import GenerationInterrupted, Sampling, generate
    from gpn_scale.eval.load import describe_loaded, load

    prompts = list(args.prompt)
    if args.prompt_file:
        path = Path(args.prompt_file)
        if not path.is_file():
            raise ConfigError(f"--prompt-file {path}: not found; give a text file")
        prompts += [line for line in path.read_text(encoding="utf-8").splitlines() if line]
    if not prompts:
        raise ConfigError("give at least one --prompt TEXT (or --prompt-file FILE)")
    _check_positive("--batch-size", args.batch_size)
    sampling = Sampling(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop_strings=tuple(args.stop),
    )
    pick_device(args.device)
    loaded = load(
        args.checkpoint,
        device=args.device,
        tokenizer=args.tokenizer,
        model_config=args.model_config,
    )
    tok = loaded.tokenizer
    for t in args.stop_token:
        if not 0 <= t < tok.vocab_size:
            raise ConfigError(f"--stop-token {t}: not a token id (0..{tok.vocab_size - 1})")
    print(f"generate: {describe_loaded(loaded)}", file=sys.stderr, flush=True)
    sampling = dataclasses.replace(
        sampling,
        stop_tokens=frozenset({tok.eod_token_id, *args.stop_token}),
        vocab_limit=tok.vocab_size,  # a padded vocabulary's extra ids are never drawn
    )
    try:
        gens = generate(
            loaded.model,
            [tok.encode(p) for p in prompts],
            sampling,
            decode=tok.decode,
            batch_size=args.batch_size or DEFAULT_BATCH,
            device=loaded.device,
        )
    except GenerationInterrupted as stop:  # Ctrl-C while decoding: the text so far
        _print_generations(args, prompts, stop.generations)
        print(
            "gpn-scale: generate interrupted by Ctrl-C; printed the text so far",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_INTERRUPTED
    _print_generations(args, prompts, gens)
    return 0


def _print_generations(args: argparse.Namespace, prompts: list[str], gens: list[Any]) -> None:
    if args.json:
        print(
            json.dumps(
                [
                    {"prompt": p, "text": g.text, "tokens": g.tokens, "stopped": g.stopped}
                    for p, g in zip(prompts, gens)
                ]
            ),
            flush=True,
        )
        return
    for i, (p, g) in enumerate(zip(prompts, gens)):
        if len(prompts) > 1:
            print(f"--- prompt {i + 1} ({len(g.tokens)} new tokens, stopped: {g.stopped})")
        print(p + g.text, flush=True)


# ------------------------------------------------------------------------------ export
def cmd_export(args: argparse.Namespace) -> int:
    try:
        from gpn_scale.eval.export import export_checkpoint

        result = export_checkpoint(
            args.checkpoint,
            args.out,
            layout=args.format,
            overwrite=args.overwrite,
            tokenizer=args.tokenizer,
            dtype=args.dtype,
            log=lambda line: print(f"export: {line}", file=sys.stderr, flush=True),
        )
    except _errors() as err:
        return _fail(err)
    step = f"step {result.step}" if result.step is not None else "step unknown"
    print(
        f"export: {result.family} ({result.parameters:,} parameters, {step}) from "
        f"{result.source} -> {result.out} ({result.layout})"
    )
    return 0
