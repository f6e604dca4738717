"""``disagg serve``: one disagg instance (a producer or a consumer) behind an HTTP server.

::

    disagg serve --config deploy/producer.yaml --port 8100     (role from the file)
    disagg serve --role consumer --config deploy/consumer.yaml --port 8200
    disagg serve --role producer --config p.yaml --engine trtllm --model MODEL

It listens on 127.0.0.1 unless ``--host`` says otherwise (``--host 0.0.0.0``: every
interface, as a container needs).

``--engine reference`` (default) runs the reference engine (a seeded tiny llama) behind an
OpenAI-compatible server (:mod:`disagg.serve.app`); producer and consumer must use the same
engine shape flags (``--layers --hidden-size --heads --kv-heads --head-dim
--intermediate-size --tokens-per-block --num-blocks --max-seq-len --dtype``) and ``--seed``
(the weights come from the seed); ``--max-num-tokens`` and ``--max-batch-size`` are the
scheduler's limits (TensorRT-LLM's names), e.g. ~1B parameters in bf16 on a GPU: ``--device cuda
--dtype bfloat16 --layers 16 --hidden-size 2048 --heads 16 --kv-heads 8 --head-dim 128
--intermediate-size 8192``. ``--tp N`` (or the config's ``tensor_parallel_size``; both
given must agree) runs N TP ranks in this process, each its own connector service; the
other role may run another TP size (docs/design/unequal-tp.md). ``/disagg/info`` reports
the shape the engine runs and every rank's control endpoint. ``--engine trtllm``
writes the ``--extra_llm_api_options`` YAML and execs ``trtllm-serve``
(:mod:`disagg.serve.trtllm`).

Exit codes: 0 after a clean shutdown, 2 for a usage or configuration error (the message
names the field and the fix), 3 when TensorRT-LLM is not installed.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from typing import Any

from .. import tuning
from ..cliargs import Parser, cuda_problem, non_negative_int, port, positive_int
from ..config import ROLES, ConfigError, DisaggConfig, load_config

log = logging.getLogger("disagg.serve")

EXIT_USAGE = 2


LOG_LEVELS = ("debug", "info", "warning", "error")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="disagg serve", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--role",
        choices=ROLES,
        default=None,
        help="producer (prefill) or consumer (decode); default: the config file's role",
    )
    p.add_argument(
        "--config",
        default=None,
        help="disagg config file (default: $TRTLLM_DISAGG_CONFIG, then $DISAGG_CONFIG)",
    )
    p.add_argument("--engine", choices=("reference", "trtllm"), default="reference")
    p.add_argument(
        "--host", default="127.0.0.1", help="HTTP bind address (0.0.0.0: every interface)"
    )
    p.add_argument("--port", type=port, default=8000, help="HTTP port")
    p.add_argument("--model", default=None, help="model name/path (trtllm; echoed by reference)")
    add_shape_args(p)
    p.add_argument(
        "--tp",
        type=positive_int,
        default=None,
        help="tensor-parallel size: reference: ranks simulated in this process; trtllm: "
        "trtllm-serve's --tp_size (default: the config's tensor_parallel_size, else 1)",
    )
    p.add_argument("--windows", default="full", help="reference: per-layer windows, e.g. 64,full")
    p.add_argument("--kv-manager", choices=("v1", "v2"), default="v2", help="reference")
    p.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="debug adds tracebacks")
    return p


# the reference engine's shape: flag -> (EngineConfig field, default); ``disagg bench
# serve`` and ``disagg bench overhead`` take the same names
SHAPE_FLAGS: dict[str, tuple[str, int]] = {
    "--layers": ("num_layers", 4),
    "--hidden-size": ("hidden_size", 128),
    "--heads": ("num_heads", 4),
    "--kv-heads": ("num_kv_heads", 2),
    "--head-dim": ("head_dim", 32),
    "--intermediate-size": ("intermediate_size", 256),
    "--tokens-per-block": ("tokens_per_block", 32),
    "--num-blocks": ("num_blocks", 1024),
    "--max-seq-len": ("max_seq_len", 8192),
    "--max-num-tokens": ("max_num_tokens", 8192),
    "--max-batch-size": ("max_batch_size", 2048),
}
DTYPES = ("float32", "bfloat16", "float16")


def add_shape_args(p: argparse.ArgumentParser, defaults: bool = True, seed: bool = True) -> None:
    """The reference engine's shape flags (``SHAPE_FLAGS``, ``--dtype``, ``--device``, and
    ``--seed`` unless ``seed=False``); producer and consumer must be given the same ones.
    ``defaults=False`` leaves each None (a caller that fills its own)."""
    for flag, (field, default) in SHAPE_FLAGS.items():
        what = field.replace("num_", "").replace("_", " ")
        p.add_argument(
            flag,
            type=positive_int,
            default=default if defaults else None,
            help=f"reference engine: {what}" + ("" if defaults else f" (default {default})"),
        )
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default="float32" if defaults else None,
        help="reference engine: weights and KV dtype",
    )
    p.add_argument("--device", default="cpu", help="reference engine device: cpu | cuda[:N]")
    if not seed:
        return
    p.add_argument(
        "--seed",
        type=non_negative_int,
        default=0,
        help="reference: weights seed (same on both roles)",
    )


def shape_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig keyword arguments from the shape flags (None: the default)."""
    out: dict[str, Any] = {}
    for flag, (field, default) in SHAPE_FLAGS.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        out[field] = default if value is None else value
    out["dtype"] = args.dtype or "float32"
    out["device"], out["seed"] = args.device, args.seed
    return out


def shape_error(e: ValueError) -> str:
    """EngineConfig's ``ValueError`` as one line that names the flag to change."""
    msg = str(e).removeprefix("EngineConfig: ")
    fields = {field: flag for flag, (field, _) in SHAPE_FLAGS.items()}
    fields.update(dtype="--dtype", device="--device", window="--windows", tp="--tp")
    names = [n for n in fields if msg.startswith(n)] or [n for n in fields if n in msg]
    return f"argument {fields[names[0]]}: {msg}" if names else msg


def _usage(msg: str) -> int:
    print(f"disagg serve: {msg}", file=sys.stderr)
    return EXIT_USAGE


def load_checked_config(path: str | None, role: str | None) -> DisaggConfig:
    """Load and validate the config; the file's role must equal ``--role`` (if given). Its
    ``tuning:`` section is installed, and a bad ``DISAGG_*`` value is a ConfigError here."""
    cfg = load_config(path)
    if role is not None and cfg.role != role:
        raise ConfigError(
            f"role: --role {role} but {cfg.source} says role: {cfg.role}; pass --role "
            f"{cfg.role} or point --config at a {role} config",
            "role",
        )
    try:
        tuning.install(cfg.tuning)
        tuning.current()
    except tuning.TuningError as e:
        raise ConfigError(str(e)) from None
    return cfg


def engine_config(args: argparse.Namespace) -> Any:
    """The reference ``EngineConfig`` from the shape flags (``ValueError`` names the flag)."""
    from ..engine.reference import EngineConfig, parse_windows

    try:
        windows = parse_windows(args.windows)
    except ValueError:
        raise ValueError(
            f"argument --windows: {args.windows!r}: give 'full' or token counts, "
            "comma-separated, e.g. 64,full"
        ) from None
    try:
        cfg = EngineConfig(
            kv_manager=args.kv_manager, windows=windows, tp=args.tp or 1, **shape_kwargs(args)
        )
    except ValueError as e:
        raise ValueError(shape_error(e)) from None
    if cfg.kv_manager == "v1" and len(cfg.layer_groups) > 1:
        raise ValueError(
            f"argument --windows: {args.windows!r}: more than one distinct window (VSWA) "
            "needs --kv-manager v2"
        )
    return cfg


def run_reference(args: argparse.Namespace, cfg: DisaggConfig, ecfg: Any) -> int:
    from ..engine.reference import ConnectorSpec, Engine
    from .app import build_app
    from .engine_loop import EngineLoop
    from .runner import run_app

    role = cfg.role
    spec = ConnectorSpec(
        f"disagg.{role}",
        f"{role.capitalize()}Scheduler",
        f"{role.capitalize()}Worker",
        extra={"config": cfg.source},
    )
    loop = EngineLoop(lambda: Engine(ecfg, connector=spec))
    try:
        loop.start()
    except (ConfigError, ValueError) as e:
        return _usage(f"config error: {e}")
    except Exception as e:
        if args.log_level == "debug":
            log.exception("engine start-up failed")
        print(f"disagg serve: the engine failed to start: {e}", file=sys.stderr)
        return 1
    app = build_app(loop, role, str(cfg.instance_id), args.model or "disagg-reference")

    async def on_cleanup(_app: Any) -> None:
        loop.stop()
        _close_services(role)

    app.on_cleanup.append(on_cleanup)
    log.info(
        "serving",
        extra={"role": role, "instance_id": cfg.instance_id, "host": args.host, "port": args.port},
    )
    # print() too: tests and operators wait for this line.
    print(f"disagg serve: {role} {cfg.instance_id} on http://{args.host}:{args.port}", flush=True)
    run_app(app, host=args.host, port=args.port)
    return 0


def _close_services(role: str) -> None:
    from .app import rank_services

    for svc in rank_services(role):  # every TP rank's
        try:
            svc.close()
        except Exception:  # shutting down: log, keep closing the rest
            log.exception("closing the %s service failed", role)


def main(argv: list[str] | None = None) -> int:
    args, extra = build_parser().parse_known_args(argv)
    from . import logs

    logs.setup(args.log_level)
    if extra and args.engine == "reference":
        return _usage(
            f"unrecognized arguments: {' '.join(extra)} (only --engine trtllm passes "
            "extra arguments on to trtllm-serve)"
        )
    ecfg: Any = None
    if args.engine == "reference":
        why = cuda_problem(args.device)
        if why is not None:
            return _usage(f"argument --device: {args.device!r}: {why}")
        try:
            ecfg = engine_config(args)
        except ValueError as e:
            return _usage(f"engine shape: {e}")
    try:
        cfg = load_checked_config(args.config, args.role)
    except ConfigError as e:
        return _usage(f"config error: {e}")
    tp, why = tp_size(args.tp, cfg)
    if why is not None:
        return _usage(why)
    if args.engine == "trtllm":
        from . import trtllm

        if tp > 1 and "--tp_size" not in extra:
            extra = [*extra, "--tp_size", str(tp)]
        return trtllm.run(cfg.role, str(cfg.source), args.model, args.host, args.port, extra)
    if ecfg.tp != tp:
        try:
            ecfg = dataclasses.replace(ecfg, tp=tp)
        except ValueError as e:
            msg = str(e).removeprefix("EngineConfig: ")
            return _usage(f"config error: tensor_parallel_size: {tp} ({cfg.source}): {msg}")
    return run_reference(args, cfg, ecfg)


def tp_size(flag: int | None, cfg: DisaggConfig) -> tuple[int, str | None]:
    """The instance's TP size: ``--tp``, else the config's ``tensor_parallel_size``, else 1;
    with a reason (one line naming both) when the two are given and differ."""
    conf = cfg.tensor_parallel_size
    if flag is not None and conf is not None and flag != conf:
        return flag, (
            f"argument --tp: {flag} but {cfg.source} says tensor_parallel_size: {conf}; "
            "give the same size or only one of them"
        )
    return flag or conf or 1, None
