"""The ``ead-llm`` command line."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the CLI imports torch and the frameworks only once the arguments are parsed (fast --help)
    from ead_llm.accounting.ledger import Pricing
    from ead_llm.policies.base import Policy
    from ead_llm.serving.limits import ServerLimits

POLICY_NAMES = ("ead", "small_only", "large_only", "speculative", "easd", "eager")
"""The policies the CLI runs, by their canonical names (``describe_policy``'s); aliases such as ``small`` and
``large`` are accepted too."""
EXTRACTOR_NAMES = ("hashes", "last_number", "first_line", "boxed", "choice", "exact", "auto", "contains")
EAD_OPTIONS = ("threshold", "window", "min_dwell", "lookahead")
DRAFT_OPTIONS = ("gamma",)
EASD_OPTIONS = ("entropy_threshold",)
EAGER_OPTIONS = ("theta", "max_paths")
APPLIES = {
    "ead": EAD_OPTIONS,
    "small_only": (),
    "large_only": (),
    "speculative": DRAFT_OPTIONS,
    "easd": DRAFT_OPTIONS + EASD_OPTIONS,
    "eager": EAGER_OPTIONS,
}
"""Which policy options each policy takes; the others are refused rather than ignored."""


def policy_name(value: str) -> str:
    """``--policy``'s value as a canonical name (argparse type)."""
    from ead_llm.policies.base import normalized_policy_name

    name = normalized_policy_name(value)
    if name not in POLICY_NAMES:
        raise argparse.ArgumentTypeError(f"choose one of {', '.join(POLICY_NAMES)} (or small, large); got {value!r}")
    return name


def _given(args: argparse.Namespace, names: tuple[str, ...]) -> list[str]:
    return [n for n in names if getattr(args, n, None) is not None]


def check_policy_options(args: argparse.Namespace) -> None:
    """Refuse policy options the chosen policy does not take (they would be silently ignored)."""
    every = EAD_OPTIONS + DRAFT_OPTIONS + EASD_OPTIONS + EAGER_OPTIONS
    stray = [n for n in _given(args, every) if n not in APPLIES[args.policy]]
    if stray:
        flags = ", ".join("--" + n.replace("_", "-") for n in stray)
        raise ValueError(f"{flags} does not apply to --policy {args.policy}")


def _policy(args: argparse.Namespace) -> Policy:
    """The policy the options name; options left out take the policy's defaults (EAD on the embedded pair: the
    settings chosen for it, ``recommended_policy()``)."""
    import dataclasses

    from ead_llm.policies.base import LargeOnly, SmallOnly
    from ead_llm.policies.eager import EAGER
    from ead_llm.policies.speculative import EASD, SpeculativeDecoding
    from ead_llm.policies.switching import EAD

    check_policy_options(args)
    if args.policy == "small_only":
        return SmallOnly()
    if args.policy == "large_only":
        return LargeOnly()
    options: dict[str, Any] = {k: v for k, v in vars(args).items() if k in APPLIES[args.policy] and v is not None}
    if args.policy == "speculative":
        return SpeculativeDecoding(**options)
    if args.policy == "easd":
        return EASD(**options)
    if args.policy == "eager":
        return EAGER(**options)
    if getattr(args, "small", None) is None and getattr(args, "large", None) is None:
        from ead_llm.embedded import recommended_policy

        return dataclasses.replace(recommended_policy(), **options)
    return EAD(**options)


def serve_policy(args: argparse.Namespace) -> Policy | None:
    """``serve``'s policy: None (the LLM's default) when no policy option is given, else what they say."""
    if args.policy == "ead" and not _given(args, EAD_OPTIONS):
        check_policy_options(args)
        return None
    return _policy(args)


def _add_policy(parser: argparse.ArgumentParser, what: str = "decoding policy") -> None:
    from ead_llm.embedded import recommended_policy
    from ead_llm.policies.switching import EAD

    pair, plain = recommended_policy(), EAD()
    lookahead = {True: "on", False: "off"}
    parser.add_argument(
        "--policy",
        type=policy_name,
        default="ead",
        help=f"{what}: {', '.join(POLICY_NAMES)} (aliases: small, large; default: ead)",
    )
    parser.add_argument(
        "--threshold",
        type=float,
        default=None,
        help=f"EAD threshold in bits (default: embedded pair {pair.threshold}, another pair {plain.threshold})",
    )
    parser.add_argument(
        "--window",
        type=int,
        default=None,
        help=f"EAD rolling window in tokens (default: embedded pair {pair.window}, another pair {plain.window})",
    )
    parser.add_argument(
        "--min-dwell",
        type=int,
        default=None,
        help=f"EAD minimum tokens between switches (default: embedded pair {pair.min_dwell}, another pair "
        f"{plain.min_dwell})",
    )
    parser.add_argument(
        "--lookahead",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="EAD: decide before the small model's token is kept, so the large model writes an uncertain token "
        "itself, instead of taking over after it "
        f"(an ead-llm addition to the published EAD; default: embedded pair {lookahead[pair.lookahead]}, another "
        f"pair {lookahead[plain.lookahead]})",
    )
    parser.add_argument("--gamma", type=int, default=None, help="speculative/EASD drafts per round (default 4)")
    parser.add_argument(
        "--entropy-threshold", type=float, default=None, help="EASD entropy threshold in bits (default 2)"
    )
    parser.add_argument("--theta", type=float, default=None, help="EAGER branching entropy in nats (default 2)")
    parser.add_argument("--max-paths", type=int, default=None, help="EAGER reasoning paths per prompt (default 8)")


def _add_sampling(parser: argparse.ArgumentParser) -> None:
    _add_policy(parser)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy, at most 2")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1]; 1 keeps every token")
    parser.add_argument("--top-k", type=int, default=0, help="keep only the k likeliest tokens; 0 keeps every token")
    parser.add_argument("--max-tokens", type=int, default=256, help="most tokens generated")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampler (same seed, same text)")
    parser.add_argument(
        "--stop", action="append", default=None, help="end the text where this appears (repeatable; default: none)"
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from ead_llm.adapters.langchain_llm import EntropyAdaptiveLLM

    prompt = args.prompt
    if args.small is None and args.large is None and not prompt.endswith("\n"):
        prompt += "\n"  # the embedded pair's prompts are a problem line: "12+35-7\n"

    llm = EntropyAdaptiveLLM(
        small=args.small,
        large=args.large,
        policy=_policy(args),
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.seed,
        stop=args.stop,
        device=args.device,
        dtype=args.dtype,
    )
    result = llm.generate([prompt])
    generation = result.generations[0][0]
    if args.json:
        info = generation.generation_info or {}
        print(json.dumps({"text": generation.text, **info}, indent=2))
    else:
        print(generation.text)
        print(json.dumps(result.llm_output["cost"] if result.llm_output else {}, indent=2), file=sys.stderr)
    return 0


def demo_policy(args: argparse.Namespace) -> Policy:
    """The demo's EAD: the settings chosen for the embedded pair, or with ``--no-lookahead`` EAD as published (window
    5, dwell 10) at the threshold chosen for that variant; ``--threshold`` replaces the threshold."""
    import dataclasses

    from ead_llm.embedded import recommended_policy, recommended_threshold
    from ead_llm.policies.switching import EAD

    policy = EAD(threshold=recommended_threshold()) if args.lookahead is False else recommended_policy()
    if args.lookahead and not policy.lookahead:  # a record without lookahead settings: the bench's dev choice
        policy = dataclasses.replace(policy, window=1, min_dwell=1, lookahead=True)
    return policy if args.threshold is None else dataclasses.replace(policy, threshold=args.threshold)


def cmd_demo(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.panel import Panel
    from rich.text import Text

    from ead_llm.adapters.langchain_llm import EntropyAdaptiveLLM
    from ead_llm.evaluation.task import extract_answer, problems
    from ead_llm.policies.base import policy_tag

    console = Console()
    policy = demo_policy(args)
    llm = EntropyAdaptiveLLM(policy=policy, max_tokens=400)
    tasks = problems("test", args.problems, seed=args.seed)
    result = llm.generate([t.prompt for t in tasks])
    tokenizer = llm.shared_engine.tokenizer
    right = 0
    for task, (generation,) in zip(tasks, result.generations, strict=True):
        info = generation.generation_info or {}
        text = Text(task.prompt, style="bold")
        for token_id, model in zip(info["token_ids"], info["models"], strict=True):
            piece = str(tokenizer.decode([token_id], skip_special_tokens=True))
            text.append(piece, style="bold magenta" if model == "L" else "dim")
        got = extract_answer(generation.text)
        ok = got == task.answer
        right += ok
        cost = info["cost"]
        verdict = "[green]right[/green]" if ok else f"[red]wrong[/red] (expected {task.answer})"
        console.print(
            Panel(
                text,
                title=f"answer {got}: {verdict}",
                subtitle=(
                    f"large {cost['large_tokens']}/{cost['completion_tokens']} tokens, {cost['switches']} switches, "
                    f"parameter ratio {cost['parameter_ratio']:.3f}"
                ),
            )
        )
    console.print(
        f"{policy_tag(policy)}; large-model tokens in [bold magenta]magenta[/bold magenta]; "
        f"{right}/{len(tasks)} right. Cost of the call:"
    )
    console.print_json(json.dumps(result.llm_output["cost"] if result.llm_output else {}))
    return 0


def serve_pricing(args: argparse.Namespace) -> Pricing | None:
    """The prices ``--price-*`` give (unnamed ones 0; unnamed cached-input prices the input price), or None when
    none is given."""
    from ead_llm.accounting.ledger import Pricing

    names = [f"{model}_{side}" for model in ("small", "large") for side in ("input", "output", "cached_input")]
    prices = {name: getattr(args, f"price_{name}") for name in names}
    if all(p is None for p in prices.values()):
        return None
    return Pricing(**{k: v if v is not None or "cached" in k else 0.0 for k, v in prices.items()})


def serve_config(args: argparse.Namespace) -> dict[str, Any]:
    """``EntropyAdaptiveLLM``'s arguments for ``serve`` (what is not given keeps the LLM's default)."""
    from ead_llm.policies.base import describe_policy

    policy = serve_policy(args)
    config: dict[str, Any] = {
        "small": args.small,
        "large": args.large,
        "policy": None if policy is None else describe_policy(policy),
        "max_tokens": args.max_tokens,
        "device": args.device,
        "dtype": args.dtype,
        "max_batch": args.max_batch,
        "kv_budget_tokens": args.kv_budget,
        "timeout": args.timeout,
        "pricing": serve_pricing(args),
    }
    config = {k: v for k, v in config.items() if v is not None}  # the rest: EntropyAdaptiveLLM's defaults
    if args.no_json_bounds:
        config["json_bounds"] = None
    if args.no_prefix_caching:
        config["prefix_caching"] = False
    for setting in ("exact_verification", "draft_bfloat16"):
        if getattr(args, setting) is not None:
            config[setting] = getattr(args, setting)
    return config


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from ead_llm.adapters.langchain_llm import EntropyAdaptiveLLM
    from ead_llm.serving.server import create_app

    config = serve_config(args)
    limits = serve_limits(args)
    ray_options = (args.num_cpus, args.num_gpus, args.min_replicas, args.max_replicas)
    if args.replicas > 1 or any(v is not None for v in ray_options):
        from ead_llm.serving.ray import deployment, run

        app = deployment(
            config,
            model_name=args.model_name,
            replicas=args.replicas,
            num_cpus=args.num_cpus,
            num_gpus=args.num_gpus,
            min_replicas=args.min_replicas,
            max_replicas=args.max_replicas,
            limits=limits,
        )
        run(app, host=args.host, port=args.port)
        return 0
    llm = EntropyAdaptiveLLM(**config)
    app = create_app(llm, args.model_name, limits)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def serve_limits(args: argparse.Namespace) -> ServerLimits:
    """What ``serve``'s options bound and guard (checked here: a bad value is refused before loading)."""
    from ead_llm.serving.limits import ServerLimits

    return ServerLimits(
        max_request_bytes=args.max_request_bytes,
        max_sequences=args.max_sequences_per_request,
        api_key=args.api_key or None,
        allowed_origins=tuple(args.allowed_origins),
    )


def cmd_bench(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ead_llm.evaluation.bench import (
        BenchConfig,
        EADVariant,
        bench,
        embedded_task,
        load_jsonl_task,
        planned_problems,
        render_table,
    )

    quick = args.quick
    task_only = [
        flag
        for flag, value in (
            ("--extractor", args.extractor),
            ("--dev-task", args.dev_task),
            ("--dev-fraction", args.dev_fraction),
        )
        if value is not None
    ]
    if args.task is None and task_only:
        raise ValueError(f"{', '.join(task_only)} applies to a --task file; the embedded task has its own")
    if args.task is None:
        dev = args.dev if args.dev is not None else 20 if quick else 100
        test = args.test if args.test is not None else 30 if quick else 200
        task = embedded_task(dev, test)
    else:
        task = load_jsonl_task(
            args.task,
            extractor=args.extractor or "hashes",
            dev_path=args.dev_task,
            dev_fraction=0.3 if args.dev_fraction is None else args.dev_fraction,
        ).limit(args.dev, args.test)
    overrides = {
        key: value
        for key, value in {
            "thresholds": tuple(args.thresholds) if args.thresholds else None,
            "eager_thetas": tuple(args.eager_thetas) if args.eager_thetas is not None else None,
            "eager_paths": args.eager_paths,
            "budget": args.budget,
            "budget_metric": args.budget_metric,
            "variants": tuple(EADVariant.parse(v) for v in args.variants) if args.variants else None,
            "dev_batch_size": args.dev_batch_size,
            "gamma": args.gamma,
            "easd_threshold": args.entropy_threshold,
            "max_tokens": args.max_tokens,
            "batch_size": args.batch_size,
            "seed": args.seed,
            "prompt_format": args.prompt_format,
            "stop": tuple(args.stop) if args.stop else None,
            "repeats": args.repeats,
            "router_probe": args.router_probe,
        }.items()
        if value is not None
    }
    if args.no_speculative:
        overrides["speculative"] = False
    if args.no_controls:
        overrides["controls"] = False
    config = BenchConfig.quick(**overrides) if quick else BenchConfig(**overrides)
    console = Console(stderr=True)
    total = planned_problems(task, config)
    progress: Callable[[str, int], None]
    bar: Any = contextlib.nullcontext()
    if not sys.stderr.isatty() and not args.no_progress:  # a log file or a pipe: plain lines, one per run
        done, current = [0], [""]

        def progress(label: str, count: int) -> None:
            if label != current[0]:
                print(f"ead-llm bench: {done[0]}/{total} problems done, now {label}", file=sys.stderr, flush=True)
                current[0] = label
            done[0] += count

    else:
        bar = Progress(
            TextColumn("{task.description:<28}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            disable=args.no_progress,
        )
        job = bar.add_task("loading", total=total)

        def progress(label: str, count: int) -> None:
            bar.update(job, advance=count, description=label)

    with bar:
        report, files = bench(
            args.small,
            args.large,
            task=task,
            config=config,
            out=args.out,
            device=args.device,
            dtype=args.dtype,
            progress=progress,
        )
    render_table(report, Console() if sys.stdout.isatty() else Console(width=100))
    for warning in report.timing_warnings():
        print(f"ead-llm bench: warning: {warning}", file=sys.stderr)
    for path in files.values():
        print(f"wrote {path}")
    return 0


def cmd_distill(args: argparse.Namespace) -> int:
    from ead_llm.drafts.distill import run

    card = run(args)
    print(f"wrote {args.out}: top-1 agreement {card['top1_agreement_after']:.3f} on held-out answers")
    return 0


def read_prompts(path: str) -> list[str]:
    """Prompts from a file: a ``.jsonl`` file's ``prompt`` fields (a bench task), else one prompt per non-empty
    line."""
    from pathlib import Path

    from ead_llm.evaluation.bench.tasks import jsonl_objects

    if not path.endswith(".jsonl"):
        prompts = [line for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    else:
        prompts = []
        for where, record in jsonl_objects(Path(path), "a 'prompt'"):
            if not isinstance(record.get("prompt"), str):
                raise ValueError(f"{where}: 'prompt' must be a string")
            prompts.append(record["prompt"])
    if not prompts:
        raise ValueError(f"{path} holds no prompts: one per line, or JSON lines with a 'prompt' field")
    return prompts


def cmd_calibrate(args: argparse.Namespace) -> int:
    from ead_llm.adapters.langchain_chat import ChatEntropyAdaptive
    from ead_llm.adapters.langchain_llm import EntropyAdaptiveLLM
    from ead_llm.optimize.calibrate import THRESHOLDS, calibrate
    from ead_llm.policies.base import LargeOnly

    prompts = read_prompts(args.prompts)
    kind = ChatEntropyAdaptive if args.chat else EntropyAdaptiveLLM
    model = kind(
        small=args.small,
        large=args.large,
        policy=LargeOnly(),  # calibrate sets each candidate's policy
        max_tokens=args.max_tokens,
        device=args.device,
        dtype=args.dtype,
    )
    lookahead = (True, False) if args.lookahead is None else (args.lookahead,)
    result = calibrate(
        model,
        prompts,
        target=args.target,
        thresholds=args.thresholds or THRESHOLDS,
        lookahead=lookahead,
        store=not args.no_store,
        max_concurrency=args.concurrency,
    )
    print(result.table())
    return 0 if result.reached else 1


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text).replace("\n", "\\n")


class HelpFormatter(argparse.HelpFormatter):
    """argparse's help, with each option's default where its text does not already say it (flags that are off
    and settings whose default is described in words are left as they are)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        unset = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if "default" in text or not action.option_strings or unset:
            return text
        return f"{text} (default: %(default)s)"


def _add_models(parser: argparse.ArgumentParser) -> None:
    """The pair and where it runs: --small, --large, --device, --dtype."""
    parser.add_argument("--small", default=None, help="Hugging Face id or folder (default: embedded pair)")
    parser.add_argument("--large", default=None, help="Hugging Face id or folder (default: embedded pair)")
    parser.add_argument("--device", default=None, help="torch device such as cpu or cuda:0 (default: cuda if present)")
    parser.add_argument(
        "--dtype",
        default=None,
        choices=("float32", "bfloat16", "float16"),
        help="weights' type (default: bfloat16 on a GPU that has it, else float32)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ead-llm",
        description="A small and a large LM as one cheaper LM, switching on entropy.",
        formatter_class=HelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    generate = commands.add_parser("generate", help="complete one prompt and print the text and its cost")
    generate.add_argument("prompt", help="the text to complete (the embedded pair: a problem such as 4821+3907-1568)")
    _add_models(generate)
    generate.add_argument("--json", action="store_true", help="print text, cost and per-token models as JSON")
    _add_sampling(generate)
    generate.set_defaults(func=cmd_generate)
    demo = commands.add_parser("demo", help="offline demo: EAD on the embedded pair solves a few test problems")
    demo.add_argument(
        "--threshold", type=float, default=None, help="EAD threshold in bits (default: the one chosen for the pair)"
    )
    demo.add_argument("--problems", type=int, default=5, help="how many test problems")
    demo.add_argument("--seed", type=int, default=0, help="which test problems")
    demo.add_argument(
        "--lookahead",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="EAD with lookahead, window 1, dwell 1 (default: the settings chosen for the pair on its dev split); "
        "--no-lookahead: EAD as published, window 5, dwell 10, which gets fewer answers right",
    )
    demo.set_defaults(func=cmd_demo)
    distill = commands.add_parser(
        "distill",
        help="train a draft for a model from its own answers (one layer over its hidden states, EAGLE-style)",
        description="Train a draft for MODEL that reads its hidden states; use the folder as small=.",
    )
    from ead_llm.drafts import add_arguments

    add_arguments(distill)
    distill.set_defaults(func=cmd_distill)
    calibrate = commands.add_parser(
        "calibrate",
        help="choose a pair's EAD threshold from prompts and store it (used when the pair is given no policy)",
        description="Run the prompts on LargeOnly, then on EAD at falling thresholds (with lookahead and as "
        "published), greedy; keep the cheapest setting whose text equals LargeOnly's on --target of the prompts.",
    )
    calibrate.add_argument("prompts", help="file of prompts: one per line, or JSON lines with a 'prompt' field")
    _add_models(calibrate)
    calibrate.add_argument("--chat", action="store_true", help="send each prompt as a chat message (instruct models)")
    calibrate.add_argument("--target", type=float, default=0.95, help="share of prompts agreeing with LargeOnly")
    calibrate.add_argument(
        "--thresholds",
        type=float,
        nargs="+",
        default=None,
        help="EAD thresholds in bits to try (default 0.8 0.4 0.2 0.1 0.05 0.025 0.0125)",
    )
    calibrate.add_argument(
        "--lookahead",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="try only EAD with lookahead (--lookahead) or only as published (--no-lookahead) (default: both)",
    )
    calibrate.add_argument("--max-tokens", type=int, default=128, help="most tokens per answer")
    calibrate.add_argument("--concurrency", type=int, default=4, help="prompts decoded at once")
    calibrate.add_argument("--no-store", action="store_true", help="print the choice without storing it")
    calibrate.set_defaults(func=cmd_calibrate)
    serve = commands.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on")
    _add_models(serve)
    _add_policy(serve, "default policy")
    serve.add_argument("--max-tokens", type=int, default=256, help="default max_tokens of a request")
    serve.add_argument("--max-batch", type=int, default=64, help="most sequences decoded at once")
    serve.add_argument(
        "--kv-budget",
        type=int,
        default=None,
        help="most KV positions held per model, a memory bound (default: what the models' context allows)",
    )
    serve.add_argument("--timeout", type=float, default=None, help="seconds a request may take (default: no limit)")
    serve.add_argument(
        "--model-name", default=None, help="model id clients use (default: ead-llm/embedded or ead-llm/<large model>)"
    )
    for model in ("small", "large"):
        for side in ("input", "output"):
            serve.add_argument(
                f"--price-{model}-{side}",
                type=float,
                default=None,
                help=f"USD per million {side} tokens of the {model} model (default 0 once any price is given; "
                "then usage carries cost_usd)",
            )
        serve.add_argument(
            f"--price-{model}-cached-input",
            type=float,
            default=None,
            help=f"USD per million prompt tokens the {model} model reads from its cache (default: its input price)",
        )
    serve.add_argument(
        "--max-request-bytes",
        type=int,
        default=None,
        help="largest request body; a longer one gets 413 before it is read (default: max(1 MiB, 32 x the context))",
    )
    serve.add_argument(
        "--max-sequences-per-request",
        type=int,
        default=64,
        help="most sequences (prompts x n) one request may ask for (default 64)",
    )
    serve.add_argument(
        "--api-key",
        default=os.environ.get("EAD_LLM_API_KEY"),
        help="require 'Authorization: Bearer KEY' on every route but /health (default: $EAD_LLM_API_KEY; unset: open)",
    )
    serve.add_argument(
        "--allowed-origins",
        nargs="+",
        default=(),
        metavar="ORIGIN",
        help="origins a browser may call from (CORS), such as https://app.example.com or * (default: none)",
    )
    serve.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="compute every prompt in full (default: reuse the KV blocks of prompts seen before)",
    )
    serve.add_argument(
        "--exact-verification",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="verify each speculative draft as the decode step it replaces would compute it, so greedy speculative "
        "decoding is the large model's to the last bit (default: on for large models of 50M parameters or more)",
    )
    serve.add_argument(
        "--draft-bfloat16",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run the products of a draft that reads the large model's hidden states (ead-llm distill) in bfloat16 "
        "(default: on where the CPU multiplies bfloat16 in hardware and the draft's products weigh 4 MB or more)",
    )
    serve.add_argument(
        "--no-json-bounds",
        action="store_true",
        help="lift the default length bounds of JSON under a schema (strings 256 chars, integers 15 digits, "
        "6 decimals, 64 items) where the schema sets none",
    )
    serve.add_argument(
        "--log-level",
        default="info",
        choices=("critical", "error", "warning", "info", "debug"),
        help="uvicorn's log level",
    )
    serve.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="engines behind Ray Serve (pip install 'ead-llm[ray]'; default 1: no Ray)",
    )
    serve.add_argument(
        "--num-cpus", type=float, default=None, help="Ray: CPUs reserved per replica (default: Ray's, 1)"
    )
    serve.add_argument(
        "--num-gpus", type=float, default=None, help="Ray: GPUs reserved per replica (default: Ray's, 0)"
    )
    serve.add_argument(
        "--min-replicas",
        type=int,
        default=None,
        help="Ray: autoscaling lower bound, 0 allowed (default 1 once either bound is given)",
    )
    serve.add_argument(
        "--max-replicas",
        type=int,
        default=None,
        help="Ray: autoscaling upper bound (default: --replicas once either bound is given)",
    )
    serve.set_defaults(func=cmd_serve)
    bench = commands.add_parser(
        "bench",
        help="accuracy against cost of every policy and control on a task (dev-chosen thresholds, test results)",
    )
    bench.add_argument("--quick", action="store_true", help="a small sweep on few problems (minutes)")
    bench.add_argument("--out", default="bench-results", help="folder for results.json/csv and plots")
    _add_models(bench)
    bench.add_argument("--task", default=None, help="JSONL file of {prompt, answer} (default: the embedded task)")
    bench.add_argument("--dev-task", default=None, help="JSONL file of dev problems (default: from --task)")
    bench.add_argument(
        "--dev-fraction", type=float, default=None, help="dev share of unmarked --task lines (default 0.3)"
    )
    bench.add_argument(
        "--extractor", default=None, help="answer extractor of a --task (default hashes): " + ", ".join(EXTRACTOR_NAMES)
    )
    bench.add_argument(
        "--dev", type=int, default=None, help="dev problems (default: embedded 100, quick 20; a --task: all)"
    )
    bench.add_argument(
        "--test", type=int, default=None, help="test problems (default: embedded 200, quick 30; a --task: all)"
    )
    bench.add_argument(
        "--thresholds",
        type=float,
        nargs="+",
        default=None,
        help="EAD thresholds (bits) to sweep (default 0.05 0.1 0.2 0.4, quick 0.1 0.4)",
    )
    bench.add_argument("--budget", type=float, default=None, help="cost budget for the dev choice (default 0.25)")
    bench.add_argument(
        "--budget-metric",
        choices=("large_fraction", "parameter_ratio"),
        default=None,
        help="what --budget bounds (default large_fraction)",
    )
    bench.add_argument(
        "--variants",
        nargs="+",
        default=None,
        help="EAD variants WINDOW:MIN_DWELL[:lookahead][:large] (default: 5:10 1:1:lookahead; "
        "large: start on the large model)",
    )
    bench.add_argument("--gamma", type=int, default=None, help="speculative/EASD drafts per round (default 4)")
    bench.add_argument("--entropy-threshold", type=float, default=None, help="EASD threshold, bits (default 2)")
    bench.add_argument(
        "--eager-thetas",
        type=float,
        nargs="*",
        default=None,
        help="EAGER thetas to sweep, nats (default 0.4 0.8, quick 0.8; the flag alone: skip EAGER)",
    )
    bench.add_argument("--eager-paths", type=int, default=None, help="EAGER max_paths (default 8, quick 4)")
    bench.add_argument("--max-tokens", type=int, default=None, help="per completion (default 400)")
    bench.add_argument("--batch-size", type=int, default=None, help="test requests per engine call (default 1)")
    bench.add_argument("--dev-batch-size", type=int, default=None, help="dev requests per engine call (default 32)")
    bench.add_argument("--seed", type=int, default=None, help="sampling seed of every run (default 0)")
    bench.add_argument(
        "--prompt-format",
        choices=("text", "chat"),
        default=None,
        help="prompts as plain text or through the tokenizer's chat template (default text)",
    )
    bench.add_argument("--no-speculative", action="store_true", help="skip speculative decoding and EASD")
    bench.add_argument(
        "--no-controls", action="store_true", help="skip the random, fixed-block and oracle controls and the router"
    )
    bench.add_argument(
        "--router-probe", type=int, default=None, help="tokens the query router reads before routing a call (default 8)"
    )
    bench.add_argument(
        "--repeats", type=int, default=None, help="timings per test run, the median counts (default 1, quick 3)"
    )
    bench.add_argument(
        "--stop", action="append", default=None, help="stop string of every completion (repeatable; default: none)"
    )
    bench.add_argument("--no-progress", action="store_true", help="no progress bar (or line)")
    bench.set_defaults(func=cmd_bench)
    return parser


class _Parser(argparse.ArgumentParser):
    """A subcommand's parser: the same help formatter as the command's."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def one_line(err: BaseException) -> str:
    """An error as one line that names the parameter, the value and the rule: pydantic's validation
    errors lose their dump (``1 validation error for ... input_value=...``), ours pass as they are."""
    errors = getattr(err, "errors", None)
    if callable(errors):
        try:
            first = errors()[0]
        except Exception:
            return str(err).splitlines()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
        if where and where not in message:
            message = f"{where}: {message} (got {first.get('input')!r})"
        return message
    return " ".join(str(err).split("\n")[0].split()) or type(err).__name__


def check_args(args: argparse.Namespace) -> None:
    """Refuse, before torch and the models load, whatever the options get wrong that can be seen without them:
    model folders, the policy and its settings, sampling settings, counts and the server's limits."""
    from ead_llm.core.request import SamplingParams
    from ead_llm.core.sources import check_source
    from ead_llm.core.validation import check_float, check_int

    small, large = getattr(args, "small", None), getattr(args, "large", None)
    if hasattr(args, "small") and (small is None) != (large is None):  # a pair's commands (distill takes one model)
        raise ValueError("pass both --small and --large, or neither for the embedded pair")
    for name, source in (("small", small), ("large", large)):
        if source is not None:
            check_source(name, source)
    if args.command == "generate":
        _policy(args)
        SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            max_tokens=args.max_tokens,
            stop=tuple(args.stop or ()),
            seed=args.seed,
        )
    elif args.command == "demo":
        demo_policy(args)
        check_int("--problems", args.problems, minimum=1)
        check_int("--seed", args.seed, minimum=0)
    elif args.command == "calibrate":
        if small is None:
            raise ValueError("calibrate needs --small and --large: the embedded pair is calibrated already")
        check_float("--target", args.target, minimum=0.0, maximum=1.0)
        check_int("--max-tokens", args.max_tokens, minimum=1)
        check_int("--concurrency", args.concurrency, minimum=1)
        for threshold in args.thresholds or ():
            check_float("--thresholds", threshold, minimum=0.0, allow_inf=True)
    elif args.command == "serve":
        serve_policy(args)
        SamplingParams(max_tokens=args.max_tokens)
        check_int("--port", args.port, minimum=0, maximum=65535)
        check_int("--max-batch", args.max_batch, minimum=1)
        check_int("--replicas", args.replicas, minimum=1)
        for name, least in (("kv_budget", 1), ("min_replicas", 0), ("max_replicas", 1)):
            if getattr(args, name) is not None:
                check_int("--" + name.replace("_", "-"), getattr(args, name), minimum=least)
        if args.timeout is not None:
            check_float("--timeout", args.timeout, minimum=0.0, exclusive_minimum=True)
        for name in ("num_cpus", "num_gpus"):
            if getattr(args, name) is not None:
                check_float("--" + name.replace("_", "-"), getattr(args, name), minimum=0.0)
        serve_pricing(args)
        serve_limits(args)
    elif args.command == "bench":
        counts = (
            "dev",
            "test",
            "max_tokens",
            "batch_size",
            "dev_batch_size",
            "repeats",
            "eager_paths",
            "gamma",
            "router_probe",
        )
        for name in counts:
            if getattr(args, name) is not None:
                check_int("--" + name.replace("_", "-"), getattr(args, name), minimum=1)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_args(args)
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # no "Loading weights" bars in a command's output
        return int(args.func(args))
    except (ValueError, FileNotFoundError, OSError) as err:
        print(f"ead-llm: error: {one_line(err)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
