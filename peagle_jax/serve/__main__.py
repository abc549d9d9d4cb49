"""``python -m peagle_jax.serve``: an OpenAI-compatible HTTP server with continuous batching.

Examples::

    python -m peagle_jax.serve                                   # embedded SmolLM2 on 127.0.0.1:8000
    python -m peagle_jax.serve --model /path/to/hf_model --drafter /path/to/drafter --k 5 --max-batch 8
    python -m peagle_jax.serve serve                             # SageMaker: 0.0.0.0:8080, /opt/ml/model
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import faulthandler
import logging
import os
import signal
import socket
import sys
from pathlib import Path

import uvicorn

from peagle_jax import errors
from peagle_jax.drafter.shipped import DEFAULT_FOR_MODEL, check_speculation_flags, default_tree, resolve_drafter
from peagle_jax.engine.buckets import parse_window_buckets
from peagle_jax.errors import UserError

SAGEMAKER_MODEL_DIR = Path("/opt/ml/model")
SAGEMAKER_PORT = 8080
# SageMaker sets this where a container must listen elsewhere than 8080 (e.g. behind another in an
# inference pipeline).
SAGEMAKER_PORT_ENV = "SAGEMAKER_BIND_TO_PORT"


def build_parser() -> argparse.ArgumentParser:
    from peagle_jax.loading import add_experts_flag

    p = errors.ArgumentParser(
        prog="python -m peagle_jax.serve",
        description="OpenAI-compatible server (completions, chat, streaming, metrics, SageMaker /ping and "
        "/invocations) with continuous batching over fixed slots and optional P-EAGLE speculative decoding.",
    )
    p.add_argument(
        "mode",
        nargs="?",
        choices=["serve"],
        help="'serve' is how SageMaker starts a container (docker run IMAGE serve): same as --sagemaker",
    )
    p.add_argument(
        "--model",
        help="Hugging Face model directory, or 'smollm2' for the embedded SmolLM2-135M-Instruct (default; with "
        "--sagemaker: /opt/ml/model when it holds a config.json)",
    )
    p.add_argument(
        "--drafter",
        help="drafter directory (speculators / EAGLE / converted); enables speculative decoding (default: the "
        "shipped P-EAGLE drafter for the embedded smollm2, none for other models; with --sagemaker: "
        "/opt/ml/model/drafter when present)",
    )
    p.add_argument(
        "--k",
        type=int,
        help="draft tokens per step, a chain of K; 0 = no speculation (default: the drafter config's K)",
    )
    p.add_argument(
        "--tree",
        help="static draft tree as comma-separated rank paths, e.g. 0,1,00,10 (default: as in generate, the "
        "shipped drafter's own tree without --k, e.g. 0,1,2,3,4,00,01 for smollm2-peagle; else a chain of K)",
    )
    p.add_argument("--sequential", action="store_true", help="EAGLE-3 sequential drafting instead of parallel")
    p.add_argument("--fused", action="store_true", help="draft and verify in one graph per step")
    p.add_argument(
        "--load-k",
        help="how many tokens a step drafts: 'auto' (default) picks, per step, a plain step or --k / --tree, "
        "whichever it measured to give the most tokens per second at the current load (where drafting does "
        "not pay, the drafter's own work is skipped too); 'auto:1' (or 'auto:1,2', ...) also a chain of each "
        "length listed, shorter than --k / --tree (each adds its graphs to compile); 'none' "
        "always drafts --k / --tree; or N:K pairs, e.g. '4:2,12:0' = with at least 4 active requests draft "
        "and verify a chain of 2, with 12 decode plainly (K 0)",
    )
    p.add_argument("--host", default=None, help="address to bind (default 127.0.0.1; --sagemaker: 0.0.0.0)")
    p.add_argument(
        "--port",
        type=int,
        default=None,
        help="port (default 8000; --sagemaker: $SAGEMAKER_BIND_TO_PORT if set, else 8080)",
    )
    p.add_argument("--max-batch", type=int, default=8, help="slots: requests decoded together (default 8)")
    p.add_argument(
        "--max-seq-len", type=int, default=2048, help="context per request: prompt + max_tokens (default 2048)"
    )
    p.add_argument(
        "--window-buckets",
        default=None,
        help="attention windows below --max-seq-len, comma-separated, e.g. 512: a step attends over the "
        "smallest one covering its context, or over the whole cache past them ('none': always the whole "
        "cache). Each window is a set of graphs to compile; fewer make short contexts' steps slower "
        "(default: 128,256,512,... below --max-seq-len)",
    )
    p.add_argument(
        "--max-queue", type=int, default=64, help="requests waiting for a slot before 429 answers (default 64)"
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("PEAGLE_API_KEY"),
        help="require 'Authorization: Bearer KEY' on every /v1 route (401 otherwise; /health, /ping, /metrics "
        "and SageMaker's /invocations stay open); default: $PEAGLE_API_KEY, else no key",
    )
    p.add_argument(
        "--max-body-size",
        default="8MiB",
        help="largest request body; a larger one is answered 413 before the rest is read (default 8MiB; "
        "units as 500KB, 8MiB)",
    )
    p.add_argument(
        "--platform",
        default="cpu",
        help="cpu (default), gpu, tpu or neuron; an accelerator needs its JAX plugin (the error says how to get it)",
    )
    p.add_argument(
        "--compilation-cache",
        help="JAX persistent compilation cache directory, with the decoding graphs' executables in its executables/ "
        "(a restart loads them untraced), or 'none' to disable both (default: MODEL/jax-cache when the model "
        "directory brings one, see --warmup-only; else $JAX_COMPILATION_CACHE_DIR; else ~/.cache/peagle_jax/jax-cache)",
    )
    p.add_argument(
        "--warmup-only",
        action="store_true",
        help="compile every graph these flags serve into the compilation cache and exit without serving; with "
        "--compilation-cache MODEL/jax-cache the model directory brings its compiled graphs (a SageMaker or "
        "Neuron endpoint then compiles nothing at start; run it on the instance type and software that serve)",
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="weights/compute dtype (default float32)",
    )
    add_experts_flag(p)
    p.add_argument(
        "--compile",
        choices=["background", "first"],
        default="background",
        help="'background' (default): compile what a short prompt's first request needs, answer /health ready, "
        "and compile the other graphs on a second thread while serving (meanwhile drafting steps whose graphs "
        "are not ready run as plain steps, with the same output; the second thread holds a second KV cache); "
        "'first': compile every graph before /health turns ready",
    )
    p.add_argument(
        "--sync-steps",
        action="store_true",
        help="read each step's tokens before launching the next (default: plain steps overlap the host; for A/B runs)",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=["hermes", "qwen3_coder", "llama3_json", "openai", "none"],
        help="the model's tool-call syntax, with vLLM's names: hermes (Qwen3's <tool_call> JSON), qwen3_coder "
        "(Qwen3-Coder's XML), llama3_json (Llama 3.1), openai (GPT-OSS harmony), none (no tools). Default: "
        "from the model (GPT-OSS: openai; else from its chat template; a model with none answers `tools` with 400)",
    )
    p.add_argument(
        "--reasoning-parser",
        choices=["qwen3", "openai_gptoss", "none"],
        help="the model's reasoning syntax, sent apart from the content as `reasoning`: qwen3 (<think>...</think>), "
        "openai_gptoss (harmony's analysis channel), none. Default: from the model (GPT-OSS: openai_gptoss; a "
        "chat template with <think>: qwen3)",
    )
    p.add_argument("--served-model-name", help="the `model` name clients use (default: 'smollm2' or the dir name)")
    p.add_argument("--sagemaker", action="store_true", help="SageMaker container contract (port 8080, /opt/ml/model)")
    p.add_argument("--log-level", default="warning", help="uvicorn log level (default warning)")
    return p


def select_platform(
    platform: str, compilation_cache: str | None, model: str | None = None, dtype: str | None = None
) -> str | None:
    """Point JAX at ``platform`` (and its compilation caches) before anything touches a device: the shared
    :func:`peagle_jax.platform.select_platform`, as ``generate`` does. Without ``compilation_cache``, a model
    directory's own ``jax-cache`` (its compiled graphs, :func:`peagle_jax.platform.artifact_cache`) comes
    first, then the default; ``dtype`` chooses the Neuron compiler's casting (float32 keeps float32).
    Returns the cache directory used (None: disabled)."""
    from peagle_jax.platform import artifact_cache, chosen_cache
    from peagle_jax.platform import select_platform as select

    cache = chosen_cache(compilation_cache or (model and model != "smollm2" and artifact_cache(model)) or None)
    select(platform, compilation_cache=cache, dtype=dtype)
    return None if cache is None else str(cache)


def resolve(args) -> argparse.Namespace:
    """Apply the SageMaker defaults and check the flags; returns args with every default filled in."""
    sagemaker = args.sagemaker or args.mode == "serve"
    if sagemaker:
        if args.model is None and (SAGEMAKER_MODEL_DIR / "config.json").exists():
            args.model = str(SAGEMAKER_MODEL_DIR)
        if args.drafter is None and (SAGEMAKER_MODEL_DIR / "drafter" / "config.json").exists():
            args.drafter = str(SAGEMAKER_MODEL_DIR / "drafter")
    args.sagemaker = sagemaker
    args.model = args.model or "smollm2"
    args.host = args.host or ("0.0.0.0" if sagemaker else "127.0.0.1")
    if args.port is None:
        args.port = sagemaker_port() if sagemaker else 8000
    flags = {"--tree": args.tree, "--sequential": args.sequential, "--fused": args.fused, "--load-k": args.load_k}
    check_speculation_flags(args.drafter or DEFAULT_FOR_MODEL.get(args.model), args.k, flags)
    args.load_k, adaptive, args.chains = parse_load_k(args.load_k)
    for flag, value, low in (
        ("--max-batch", args.max_batch, 1),
        ("--max-seq-len", args.max_seq_len, 2),
        ("--max-queue", args.max_queue, 1),
    ):
        if value is not None and value < low:
            raise UserError(f"{flag} must be >= {low}, got {value}")
    if not 0 <= args.port < 65536:
        raise UserError(f"--port must be in 0..65535, got {args.port}")
    try:
        args.window_buckets = parse_window_buckets(args.window_buckets)
    except ValueError as err:
        raise UserError(f"--window-buckets: {err}") from None
    from peagle_jax.models.tensors import parse_size

    args.max_body_size = parse_size(args.max_body_size)
    args.api_key = args.api_key or None  # an empty key (or $PEAGLE_API_KEY='') means none
    args.drafter = resolve_drafter(args.model, args.drafter, args.k)
    args.tree = default_tree(args.drafter, args.k, args.tree)
    args.adaptive_k = adaptive and args.drafter is not None
    return args


def sagemaker_port() -> int:
    """The port SageMaker expects: ``$SAGEMAKER_BIND_TO_PORT`` where it sets one, else 8080."""
    value = os.environ.get(SAGEMAKER_PORT_ENV, "").strip()
    if not value:
        return SAGEMAKER_PORT
    if not value.isdigit():
        raise UserError(f"{SAGEMAKER_PORT_ENV}={value!r}: expected a port number")
    return int(value)


def parse_load_k(spec: str | None) -> tuple[list[tuple[int, int]], bool, tuple[int, ...] | None]:
    """``--load-k`` -> (N:K pairs, adaptive, the adaptive step length's chains): ``'4:2,12:0'`` ->
    ([(4, 2), (12, 0)], False, None); None or ``'auto'`` -> ([], True, None: the default chains);
    ``'auto:1,2'`` -> ([], True, (1, 2)); ``'none'`` -> ([], False, None)."""
    spec = None if spec is None else spec.strip()
    if spec is None or spec == "auto":
        return [], True, None
    if spec == "none":
        return [], False, None
    if spec.startswith("auto:"):
        try:
            chains = tuple(int(x) for x in spec[len("auto:") :].split(","))
        except ValueError:
            chains = ()
        if not chains or min(chains) < 1:
            raise UserError(f"--load-k {spec!r}: expected 'auto:' and chain lengths >= 1, e.g. auto:1 or auto:1,2")
        return [], True, chains
    try:
        pairs = [tuple(int(x) for x in item.split(":")) for item in spec.split(",")]
    except ValueError:
        pairs = []
    if not pairs or any(len(p) != 2 for p in pairs):
        raise UserError(
            f"--load-k {spec!r}: expected 'auto', 'auto:1', 'none' or comma-separated N:K pairs, e.g. 4:2,12:0"
        )
    return pairs, False, None


def load(args):
    """(generator, tokenizer, stop ids, model name, chat format) for the resolved args."""
    from peagle_jax.chat.format import detect
    from peagle_jax.loading import GeneratorOptions, build_generator, load_tokenizer, resolve_model_dir

    model_dir = resolve_model_dir(args.model)
    tokenizer = load_tokenizer(model_dir)
    opts = GeneratorOptions(
        dtype=args.dtype,
        max_seq_len=args.max_seq_len,
        drafter=args.drafter,
        k=args.k,
        tree=args.tree,
        sequential=args.sequential,
        fused=args.fused,
        experts=args.experts,
        window_buckets=args.window_buckets,
    )
    gen = build_generator(opts, model_dir)
    template = getattr(tokenizer, "chat_template", None)
    chat = detect(gen.cfg.family, template if isinstance(template, str) else None, args.tool_call_parser,
                  args.reasoning_parser)  # fmt: skip
    stops = set(gen.cfg.eos_token_ids) | set(chat.stop_ids())
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        stops.add(tokenizer.eos_token_id)
    name = args.served_model_name or ("smollm2" if args.model == "smollm2" else Path(args.model).resolve().name)
    return gen, tokenizer, tuple(sorted(stops)), name, chat


def grammars_for(tokenizer, vocab_size: int, stops):
    """The model's :class:`~peagle_jax.grammar.Grammars` for structured outputs; None without a (fast)
    tokenizer, and then a request with a grammar is a 400 that says so."""
    if tokenizer is None:
        return None
    from peagle_jax.grammar import Grammars

    try:
        return Grammars(tokenizer, vocab_size, stops)
    except ValueError as err:
        logging.getLogger("peagle_jax.serve").warning("structured outputs are off: %s", err)
        return None


def curl_example(host: str, port: int, name: str) -> str:
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    body = f'{{"model": "{name}", "messages": [{{"role": "user", "content": "Say hello."}}], "max_tokens": 32}}'
    return f"curl -s http://{shown}:{port}/v1/chat/completions -H 'Content-Type: application/json' -d '{body}'"


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if hasattr(signal, "SIGUSR1") and __name__ == "__main__":  # kill -USR1 PID: every thread's stack on stderr
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        args = resolve(args)
        sock = None
        if not args.warmup_only:
            sock = listen_socket(args.host, args.port)  # a taken port is said at once, before anything loads
            args.port = sock.getsockname()[1]
        args.compilation_cache = select_platform(args.platform, args.compilation_cache, args.model, args.dtype)
        # Every module of the graphs is imported here, before the executables loaded ahead are unpickled on
        # another thread (which imports their pytree classes' modules): two threads importing one package's
        # circular imports (flax's) can each see the other's half-initialized module.
        from peagle_jax import executables
        from peagle_jax.serve.slots import SlotEngine

        if not args.warmup_only:  # while the weights and tokenizer load; stopped when the warm-up starts
            executables.load_ahead()
        gen, tokenizer, stops, name, chat = load(args)

        # Log-probabilities are computed in every step graph (one static flag, so a request that asks for
        # them compiles nothing): the log-softmax and top 20 of the emitted positions only. Likewise every
        # step takes the slots' penalties, logit biases and grammar masks (skipped inside the graph while no
        # row has any).
        engine = SlotEngine(
            gen, args.max_batch, load_k=args.load_k, adaptive=args.adaptive_k, chains=args.chains, logprobs=True,
            rules=True,
            grammars=grammars_for(tokenizer, gen.cfg.vocab_size, stops),
        )  # fmt: skip
        engine.overlap = not args.sync_steps
        if args.warmup_only:
            return warmup_only(args, engine)
    except (UserError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        from peagle_jax import executables

        executables.stop_ahead(wait=True)  # exiting while it deserializes would abort the process
        return 2
    return serve(args, engine, tokenizer, stops, name, chat, sock)


def warmup_only(args, engine) -> int:
    """``--warmup-only``: compile every graph of the server into the compilation cache, say how many were
    already there, and exit 0."""
    from tqdm import tqdm

    from peagle_jax import executables
    from peagle_jax.platform import compilation_cache_counts

    if args.compilation_cache is None:
        raise UserError("--warmup-only needs a compilation cache (not --compilation-cache none)")
    with tqdm(desc="compile", unit="graph", disable=None) as bar:

        def progress(done, total):
            bar.total = total
            bar.n = done
            bar.refresh()

        seconds = engine.warmup(progress, calibrate=False)
    counts, stored = compilation_cache_counts(), executables.counts()
    print(
        f"compiled {counts['misses']} graphs into {args.compilation_cache} in {seconds:.1f} s "
        f"({counts['hits']} were there already; {stored['loaded']} executables loaded, {stored['compiled']} "
        "stored); serve with the same flags and this cache to compile none"
    )
    return 0


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (uvicorn listens on it once the app starts); a port in use or a
    host that cannot be bound is a :class:`UserError`."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
    return sock


def serve(args, engine, tokenizer, stops, name, chat, sock: socket.socket | None = None) -> int:
    from peagle_jax.serve.app import ServerState, build_app
    from peagle_jax.serve.metrics import Metrics
    from peagle_jax.serve.worker import EngineWorker

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    log = logging.getLogger("peagle_jax.serve")
    metrics = Metrics()
    metrics.max_slots = engine.B
    metrics.spec_stats = engine.gen.spec if engine.speculative else None
    metrics.steps_by_k = engine.steps_by_k if engine.speculative else None
    metrics.structured = engine.structured if engine.grammars is not None else None
    if engine.speculative:
        metrics.lazy_drafter = lambda: (engine.unsynced_admits, engine.resyncs)
    if engine.policy is not None:
        metrics.policy_step_s = lambda: dict(engine.policy.step_s)  # a copy: the engine thread updates it
    worker = EngineWorker(engine, max_queue=args.max_queue, metrics=metrics)
    metrics.queue_depth = lambda: worker.queue_depth
    metrics.graphs = lambda: (worker.graphs_compiled, worker.graphs_pending, worker.compile_s)
    if args.compilation_cache is not None:
        log.info("compilation cache: %s", args.compilation_cache)
    metrics.active_slots = lambda: engine.active
    state = ServerState(
        worker, tokenizer, name, args.max_seq_len, stops, max_body_bytes=args.max_body_size, api_key=args.api_key,
        chat=chat,
    )  # fmt: skip

    def progress(phase, done, total):
        if done == total or done % 8 == 0:
            where = "" if phase == "start" else " in the background"
            log.info("compiling graphs%s: %d/%d", where, done, total)

    async def announce():
        await asyncio.get_running_loop().run_in_executor(None, _wait_ready, worker)
        if worker.user_error:  # nothing can be served: say why and stop (exit status 2)
            print(f"error: {worker.failed}", file=sys.stderr, flush=True)
            server.should_exit = True
            return
        if worker.stopping:
            return
        if worker.failed or not worker.ready.is_set():
            log.error("warm-up failed; /health stays 503")
            return
        pending = f", {worker.graphs_pending} more compiling in the background" if worker.graphs_pending else ""
        print(f"ready: serving {name!r} on http://{args.host}:{args.port} (warm-up {worker.warmup_s:.1f} s{pending})")
        print(f"decoding: {engine.describe()}")
        print(curl_example(args.host, args.port, name), flush=True)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        log.info("compiling graphs on %s:%d (/health answers 503 until ready)", args.host, args.port)
        worker.start(background=args.compile == "background", progress=progress)
        task = asyncio.create_task(announce())
        yield
        worker.stop_compiling()  # before ready, the warm-up stops after its graph (announce then returns)
        task.cancel()

    app = build_app(state, lifespan=lifespan)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    server = DrainingServer(config)
    server.run(sockets=None if sock is None else [sock])
    if not worker.shutdown():
        log.error("background compilation did not stop within 300 s; exiting anyway")
        logging.shutdown()
        os._exit(2 if worker.user_error else 0)  # skip interpreter teardown under a running XLA compile
    return 2 if worker.user_error else 0


class DrainingServer(uvicorn.Server):
    """uvicorn drains in-flight requests on SIGTERM and then re-raises the signal, so the process would end
    with status 143; SIGTERM is how orchestrators (Kubernetes, SageMaker, systemd) stop a server, and a
    drained stop exits 0. SIGINT keeps uvicorn's behaviour (a second one forces the exit)."""

    @contextlib.contextmanager
    def capture_signals(self):
        with super().capture_signals():
            yield
            self._captured_signals = [s for s in self._captured_signals if s != signal.SIGTERM]


def _wait_ready(worker) -> None:
    while not worker.ready.wait(0.2):
        if worker.failed or not worker.alive or worker.stopping:
            return


if __name__ == "__main__":
    sys.exit(main())
