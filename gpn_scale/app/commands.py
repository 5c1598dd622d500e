"""`gpn-scale train | demo | eval`: argument parsing only; the work is in train/loop.py (the
Trainer, built with assemble.py's step callbacks), demo.py and, for `eval --task / --lm-eval`,
eval/commands.py.

Heavy imports (torch, deepspeed, streaming) happen inside the handlers so `--help` is fast.
Exit codes: 0 done; 2 bad config / checkpoint / credentials / data (one line on stderr,
nothing written), a disk that refuses a write (full, read-only: one line naming the
file), or a run taken over by another job (--take-over: nothing more written); 3 stopped
after too many non-finite steps; 75 preempted (or a first Ctrl-C) after a successful save
(rerun: `--resume auto` is the default); 130 aborted by a second Ctrl-C.
"""

from __future__ import annotations

import argparse
import sys

RESUME_HELP = (
    "'auto' = newest complete checkpoint under checkpoint.root (local or S3), "
    "'none' = start fresh, or a checkpoint URI (default: %(default)s)"
)


class _IntermixedParser(argparse.ArgumentParser):
    """Lets options sit anywhere among the overrides (`train cfg --resume auto a=1 b=2`);
    plain argparse stops collecting a nargs='*' positional at the first option."""

    def parse_known_args(self, args=None, namespace=None):
        if getattr(self, "_intermixing", False):  # the inner calls of the intermixed parse
            return super().parse_known_args(args, namespace)
        self._intermixing = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixing = False


class _HelpConfig(argparse.Action):
    """`train --help-config`: like --help, it prints and exits before anything is parsed."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, **kw):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        from gpn_scale.run.config import format_config_help

        print(format_config_help())
        parser.exit(0)


def register(subparsers: argparse._SubParsersAction) -> None:
    # add_parser has no per-call class argument; swap the action's class for our three.
    previous = subparsers._parser_class
    subparsers._parser_class = _IntermixedParser
    try:
        _register(subparsers)
    finally:
        subparsers._parser_class = previous


def _config_and_overrides(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    """The optional CONFIG positional: a first argument of the form key=value is an override."""
    if args.config is not None and "=" in args.config:
        return None, [args.config, *args.overrides]
    return args.config, list(args.overrides)


def _register(subparsers: argparse._SubParsersAction) -> None:
    _register_train(subparsers)
    _register_demo(subparsers)
    _register_eval(subparsers)


def _register_train(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "train",
        help="train a GPN / GPN+M (single process, torchrun or SLURM)",
        description="Train from a YAML config (configs/train/<name>.yaml or a path) with "
        "key=value overrides, e.g. `gpn-scale train ci_tiny optim.lr=1e-3 "
        "--resume auto`. Exit codes: 0 done, 2 bad input, 3 non-finite stop, "
        "75 preempted or Ctrl-C (checkpoint saved), 130 a second Ctrl-C.",
    )
    p.add_argument(
        "config",
        nargs="?",
        default=None,
        help="training config name or YAML path (omit it to start from the "
        "schema's defaults, e.g. for sweep runs given entirely as overrides)",
    )
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="dotlist overrides of the config, e.g. optim.lr=1e-3 run_dir=runs/x "
        "(keys: docs/training.md)",
    )
    p.add_argument(
        "--resume",
        default=None,
        help=RESUME_HELP.replace(
            "'none' = start fresh",
            "'none' (or 'never') = start fresh, refused over existing checkpoints",
        ).replace("(default: %(default)s)", "(default: auto); a finished run is left as it is"),
    )
    p.add_argument(
        "--fresh",
        action="store_true",
        help="start over at step 0: deletes the checkpoints, DONE and metrics "
        "history already under checkpoint.root / run_dir (after the setup "
        "succeeds); implies --resume none",
    )
    p.add_argument(
        "--latest-step",
        action="store_true",
        help="print the step of the newest complete checkpoint under checkpoint.root "
        "(-1: none; 'done' when the run finished) and exit: slurm/train.sbatch requeues "
        "only when it advanced (after the check of --check-launch when both are given)",
    )
    p.add_argument(
        "--check-launch",
        nargs=2,
        type=int,
        metavar=("NODES", "PROCS_PER_NODE"),
        default=None,
        help="check, without reading or writing anything, that the config trains on NODES "
        "x PROCS_PER_NODE processes (parallel.tp divides the world and the model's heads, "
        "widths and vocabulary, and each data-parallel rank's micro batch) and exit: "
        "slurm/train.sbatch runs it before starting the trainers",
    )
    p.add_argument(
        "--take-over",
        action="store_true",
        help="train even though another job holds a live lease on the run "
        "(<checkpoint.root>/LEASE); only once that job has stopped",
    )
    p.add_argument(
        "--help-config",
        action=_HelpConfig,
        help="list every config key with its type, default and meaning (from the schema) "
        "and exit; reads no config, checks nothing",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="resolve and check the config, model, data and checkpoint locations "
        "(read-only), print the resolved config and what the run would use; "
        "train nothing, write nothing",
    )
    p.set_defaults(func=cmd_train)


def _register_demo(subparsers: argparse._SubParsersAction) -> None:
    d = subparsers.add_parser(
        "demo",
        help="build the default corpus, train a small GPN+M on CPU, evaluate, plot",
        description="The README's main command: a fresh-install, CPU-only end-to-end run "
        "(a minute or two). Leaves a checkpoint, metrics.jsonl and loss_curve.png.",
    )
    d.add_argument("--out", default="runs/demo", help="run directory (default runs/demo)")
    d.add_argument(
        "--steps",
        type=int,
        default=None,
        help="override schedule.total_steps (>= 1; default: the demo config's)",
    )
    d.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="dotlist overrides of configs/train/demo.yaml, e.g. train.device=cpu",
    )
    d.set_defaults(func=cmd_demo)


def _register_eval(subparsers: argparse._SubParsersAction) -> None:
    e = subparsers.add_parser(
        "eval",
        help="held-out loss / perplexity of a checkpoint; LAMBADA; lm-eval tasks",
        description="Evaluate a checkpoint on the validation split (fixed windows: the "
        "first eval.batches batches; writes nothing), or with --task / --lm-eval "
        "(`gpn-scale eval CHECKPOINT --task lambada --data FILE`) score CHECKPOINT on a "
        "task and write the result JSON beside it. Exit codes: 0 done, 2 bad "
        "input (one line on stderr).",
    )
    e.add_argument(
        "config",
        help="the training config the checkpoint was trained with; with --task / --lm-eval "
        "the CHECKPOINT (step dir, checkpoint root, run dir or model_final.pt)",
    )
    e.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="the same dotlist overrides as the training run (run_dir, "
        "checkpoint.root, data.remote, model_overrides, ...), plus eval.* "
        "(e.g. eval.batch_size=8)",
    )
    e.add_argument(
        "--checkpoint", default="auto", help=RESUME_HELP.replace("start fresh", "untrained")
    )
    e.add_argument(
        "--batches",
        type=int,
        default=None,
        help="number of validation batches (default: eval.batches of the config)",
    )
    e.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (eval/loss, eval/ppl, eval/tokens, checkpoint, "
        "step, tokens) on stdout; log lines go to stderr",
    )
    from gpn_scale.eval.commands import add_model_flags, add_task_flags

    add_task_flags(e)
    add_model_flags(e)
    e.set_defaults(func=cmd_eval)


def _errors():
    """Exception types that end a command with one line and exit code 2."""
    from gpn_scale.core.config import ConfigError

    types: list[type[BaseException]] = [ConfigError]
    try:
        from gpn_scale.data import DataError

        types.append(DataError)
    except ImportError:  # pragma: no cover - data package absent
        pass
    return tuple(types)


def _disk_failure(err: OSError) -> str | None:
    """One line for a write the disk refused (full, read-only, no permission, I/O error)
    wherever it happened (the trainer's own writers name theirs); None: a bug, traceback."""
    import errno

    from gpn_scale.io.storage import DISK_ERRNOS, os_error_line

    if err.errno not in DISK_ERRNOS:
        return None
    action = "write" if err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS) else "access"
    where = err.filename if err.filename is not None else "a file"
    return os_error_line(action, where, err, "run_dir / checkpoint.root")


def _fail(err: BaseException | str) -> int:
    msg = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    from gpn_scale.io.storage import redact_urls  # no endpoint password in a line

    print(f"gpn-scale: error: {redact_urls(msg)}", file=sys.stderr, flush=True)
    return 2


# The checkpoint and trainer messages are written for `train`; `eval` names its own flags.
_EVAL_HINTS = (
    ("use --resume auto", "use --checkpoint auto"),
    ("--resume", "--checkpoint"),
    ("or a fresh checkpoint.root", "or another --checkpoint"),
    ("cannot resume from", "cannot evaluate"),
)


def _for_eval(err: BaseException) -> str:
    msg = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    for train_words, eval_words in _EVAL_HINTS:
        msg = msg.replace(train_words, eval_words)
    return msg


def cmd_train(args: argparse.Namespace) -> int:
    from gpn_scale.run.config import load_train_config
    from gpn_scale.train.state import TrainingError

    errors = _errors()
    if args.fresh and args.resume not in (None, "none", "never"):
        return _fail(
            ValueError(
                f"--fresh starts over; it cannot be combined with --resume "
                f"{args.resume} (drop one of them)"
            )
        )
    resume = args.resume or ("none" if args.fresh else "auto")
    try:
        cfg = load_train_config(*_config_and_overrides(args))
        # both in one call (train.sbatch's preflight): the launch is checked first
        launch, latest = getattr(args, "check_launch", None), getattr(args, "latest_step", False)
        if launch:
            from gpn_scale.train.preflight import check_launch

            for warning in check_launch(cfg, *launch):
                print(f"gpn-scale: warning: {warning}", file=sys.stderr, flush=True)
        if latest:
            print(_latest_step(cfg))
        if launch or latest:
            return 0
        if args.dry_run:
            from gpn_scale.train.preflight import dry_run

            print(dry_run(cfg, resume))
            return 0
        from gpn_scale.app.assemble import step_callbacks
        from gpn_scale.train.loop import Trainer

        result = Trainer(
            cfg,
            resume=resume,
            fresh=args.fresh,
            take_over=getattr(args, "take_over", False),
            callbacks=step_callbacks(cfg),
        ).run()
    except errors as err:
        return _fail(err)
    except OSError as err:
        line = _disk_failure(err)
        if line is None:
            raise
        return _fail(line)
    except KeyboardInterrupt:  # a second Ctrl-C (the first one saves and exits 75)
        from gpn_scale.train.signals import EXIT_ABORTED

        print(
            "gpn-scale: aborted by Ctrl-C: nothing saved since the last checkpoint; "
            "continue with --resume auto",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_ABORTED
    except TrainingError as err:
        print(f"gpn-scale: error: {err}", file=sys.stderr, flush=True)
        return 1
    if result.exit_code not in (0,):
        print(f"gpn-scale: {result.message}", file=sys.stderr, flush=True)
    return result.exit_code


def _latest_step(cfg) -> str:
    # The catalog, not CheckpointManager: no torch in train.sbatch's before/after calls.
    from gpn_scale.checkpoint import open_storage
    from gpn_scale.checkpoint.catalog import find_latest
    from gpn_scale.train.preflight import DONE_MARKER, last_ckpt_step

    storage = open_storage(cfg.resolved_checkpoint_root)
    if storage.exists(DONE_MARKER):
        return "done"
    step = last_ckpt_step(find_latest(storage)[0])
    return str(-1 if step is None else step)


def cmd_demo(args: argparse.Namespace) -> int:
    errors = _errors()
    try:
        from gpn_scale.app.demo import run_demo

        return run_demo(args.out, steps=args.steps, overrides=args.overrides)
    except errors as err:
        return _fail(err)


# --task / --lm-eval options that mean nothing to the held-out eval (refused, not ignored).
_TASK_ONLY = (
    ("data", "--data"),
    ("out", "--out"),
    ("limit", "--limit"),
    ("num_fewshot", "--num-fewshot"),
    ("include_path", "--include-path"),
    ("tokenizer", "--tokenizer"),
    ("model_config", "--model-config"),
)


def _check_heldout_flags(args: argparse.Namespace) -> None:
    from gpn_scale.core.config import ConfigError

    for attr, flag in _TASK_ONLY:
        if getattr(args, attr, None) is not None:
            raise ConfigError(
                f"{flag}: an option of --task / --lm-eval; the held-out eval reads the run's "
                "own data, model and tokenizer (override data.remote=... for other data)"
            )
    if getattr(args, "overwrite", False):
        raise ConfigError("--overwrite: the held-out eval writes no file; drop it")
    if args.device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"--device {args.device}: the held-out eval takes auto, cpu or cuda")
    if args.batch_size is not None and args.batch_size < 1:
        raise ConfigError(f"--batch-size {args.batch_size}: must be >= 1")


def cmd_eval(args: argparse.Namespace) -> int:
    if args.task or args.lm_eval is not None:  # a task on a checkpoint: gpn_scale/eval
        from gpn_scale.eval.commands import cmd_task_eval

        return cmd_task_eval(args)
    from gpn_scale.run.config import load_train_config

    errors = _errors()
    try:
        _check_heldout_flags(args)
        cfg = load_train_config(args.config, args.overrides)
        if args.device != "auto":  # the held-out eval runs where --device says, or refuses
            from gpn_scale.core.hardware import pick_device

            pick_device(args.device)
            cfg.train.device = args.device
        if args.batch_size is not None:
            cfg.eval.batch_size = args.batch_size
        if args.batches is not None:
            if args.batches < 1:
                return _fail(
                    ValueError(
                        f"--batches {args.batches}: must be >= 1 (omit it "
                        f"for eval.batches={cfg.eval.batches})"
                    )
                )
            cfg.eval.batches = args.batches
        from gpn_scale.train.loop import Trainer

        log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if args.json else None
        run = Trainer(cfg, resume=args.checkpoint, log=log, eval_only=True).run()
        result = run.final_eval
    except errors as err:
        return _fail(_for_eval(err))
    if args.json:  # stdout holds the JSON alone, for scripts
        import json

        print(
            json.dumps(
                {**result, "checkpoint": run.checkpoint, "step": run.step, "tokens": run.tokens}
            )
        )
        return 0
    print(
        f"eval: loss {result['eval/loss']:.4f}, ppl "
        f"{result['eval/ppl']:.2f} over {result['eval/tokens']:,} tokens"
    )
    return 0
