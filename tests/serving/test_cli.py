"""The ead-llm command line on a tiny pair."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from ead_llm import EAD
from ead_llm.embedded import recommended_policy, recommended_threshold
from ead_llm.serving.cli import build_parser, main, serve_config, serve_policy


def test_help_lists_commands() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "ead_llm.serving.cli", "--help"], capture_output=True, text=True, check=True
    )
    assert "generate" in out.stdout and "demo" in out.stdout and "serve" in out.stdout


def test_generate_with_speculative_policies(llama_paths, capsys: pytest.CaptureFixture[str]) -> None:
    small, large = map(str, llama_paths)
    base = ["generate", "12+35=", "--small", small, "--large", large, "--max-tokens", "8", "--json"]
    assert main([*base, "--policy", "large"]) == 0
    reference = json.loads(capsys.readouterr().out)
    assert main([*base, "--policy", "speculative", "--gamma", "3"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["token_ids"] == reference["token_ids"] and spec["cost"]["drafted_tokens"] >= 3
    assert main([*base, "--policy", "easd", "--entropy-threshold", "-1"]) == 2
    assert "entropy_threshold must be >= 0" in capsys.readouterr().err


def test_generate_json(llama_paths, capsys: pytest.CaptureFixture[str]) -> None:
    small, large = map(str, llama_paths)
    code = main(
        [
            "generate",
            "12+35=",
            "--small",
            small,
            "--large",
            large,
            "--max-tokens",
            "6",
            "--json",
            "--threshold",
            "3.0",
            "--min-dwell",
            "1",
        ]
    )
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert data["cost"]["completion_tokens"] == len(data["models"]) <= 6
    assert set(data["models"]) <= {"S", "L"}


def test_generate_refuses_bad_values_with_exit_code_2(llama_paths, capsys: pytest.CaptureFixture[str]) -> None:
    small, large = map(str, llama_paths)
    assert main(["generate", "x", "--small", small, "--large", large, "--window", "0"]) == 2
    assert "window must be >= 1" in capsys.readouterr().err
    assert main(["generate", "x", "--small", "/nope/a", "--large", "/nope/b"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_demo_runs_offline(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["demo", "--problems", "3"]) == 0
    out = capsys.readouterr().out
    assert "3/3 right" in out and "wrong" not in out  # the first screen a newcomer sees: the pair's chosen settings
    assert "lookahead=True" in out and "withheld_tokens" in out
    assert "completion_tokens" in out and "parameter_ratio" in out
    assert main(["demo", "--problems", "3", "--no-lookahead"]) == 0  # EAD as published, at its own threshold
    out = capsys.readouterr().out
    assert f"threshold={recommended_threshold()}" in out and "window=5" in out and "lookahead=False" in out
    assert "wrong (expected" in out  # a wrong answer says so, and what it should have been


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--temperature", "-1"], "temperature must be in [0.0, 2.0], got -1.0"),
        (["--top-p", "2"], "top_p must be in (0.0, 1.0], got 2.0"),
        (["--max-tokens", "0"], "max_tokens must be >= 1, got 0"),
        (["--top-k", "-3"], "top_k must be >= 0, got -3"),
        (["--stop", ""], "stop strings must not be empty"),
        (["--policy", "speculative", "--gamma", "0"], "gamma must be >= 1, got 0"),
        (["--threshold", "-0.5"], "threshold must be >= 0.0, got -0.5"),
        (["--seed", "-2"], "seed must be in [0, 9223372036854775807], got -2"),
    ],
)
def test_cli_refusals_name_parameter_value_and_range(
    llama_paths, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    small, large = map(str, llama_paths)
    assert main(["generate", "12+35=", "--small", small, "--large", large, *args]) == 2
    assert message in capsys.readouterr().err


def test_cli_bench_refuses_bad_settings(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    assert main(["bench", "--task", str(tmp_path / "missing.jsonl"), "--no-progress"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["bench", "--quick", "--budget", "2", "--no-progress"]) == 2
    assert "budget must be in [0.0, 1.0], got 2.0" in capsys.readouterr().err
    assert main(["bench", "--variants", "5", "--no-progress"]) == 2
    assert "WINDOW:MIN_DWELL" in capsys.readouterr().err


def test_serve_keeps_ead_options_given_without_a_threshold() -> None:
    def policy(*options: str):
        return serve_policy(build_parser().parse_args(["serve", *options]))

    assert policy() is None  # the LLM's own default
    pair = recommended_policy()
    assert pair.lookahead and pair != EAD()  # the embedded pair's settings differ from EAD's defaults
    assert policy("--no-lookahead") == replace(pair, lookahead=False)
    assert policy("--window", "2", "--min-dwell", "3") == replace(pair, window=2, min_dwell=3)
    assert policy("--threshold", "0.3") == replace(pair, threshold=0.3)
    folder = policy("--small", "s", "--large", "l", "--lookahead")
    assert folder == EAD(lookahead=True)  # another pair: EAD's own defaults


def test_serve_can_lift_the_json_bounds() -> None:
    from ead_llm import EntropyAdaptiveLLM, JsonBounds

    assert "json_bounds" not in serve_config(build_parser().parse_args(["serve"]))  # the LLM's default bounds
    lifted = serve_config(build_parser().parse_args(["serve", "--no-json-bounds"]))
    assert lifted["json_bounds"] is None and EntropyAdaptiveLLM(**lifted).json_bounds is None
    assert EntropyAdaptiveLLM().json_bounds == JsonBounds()
    assert serve_config(build_parser().parse_args(["serve", "--no-prefix-caching"]))["prefix_caching"] is False
    assert serve_config(build_parser().parse_args(["serve", "--exact-verification"]))["exact_verification"] is True
    assert "exact_verification" not in serve_config(build_parser().parse_args(["serve"]))
    assert serve_config(build_parser().parse_args(["serve", "--no-exact-verification"]))["exact_verification"] is False
    assert serve_config(build_parser().parse_args(["serve", "--draft-bfloat16"]))["draft_bfloat16"] is True
    assert serve_config(build_parser().parse_args(["serve", "--no-draft-bfloat16"]))["draft_bfloat16"] is False
    assert "draft_bfloat16" not in serve_config(build_parser().parse_args(["serve"]))


def test_parsing_and_help_import_neither_torch_nor_the_frameworks() -> None:
    code = (
        "import sys; from ead_llm.serving.cli import build_parser; build_parser().parse_args(['generate', 'x']); "
        "print(sorted(m for m in ('torch', 'transformers', 'langchain_core', 'dspy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--policy", "ead", "--gamma", "3"], "--gamma does not apply to --policy ead"),
        (["--policy", "large", "--threshold", "1"], "--threshold does not apply to --policy large_only"),
        (["--policy", "speculative", "--lookahead"], "--lookahead does not apply to --policy speculative"),
        (["--policy", "speculative", "--entropy-threshold", "1"], "--entropy-threshold does not apply"),
        (["--temperature", "9"], "temperature must be in [0.0, 2.0], got 9.0"),
    ],
)
def test_options_that_do_not_apply_are_refused_in_one_line(argv, needle, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "1+2", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and "validation error" not in err


def test_policy_aliases_are_one_vocabulary(capsys: pytest.CaptureFixture[str]) -> None:
    from ead_llm.policies.base import canonical_policy_name, policy_from_description

    parser = build_parser()
    for alias, name in (
        ("small", "small_only"),
        ("large", "large_only"),
        ("Large-Only", "large_only"),
        ("spec", "speculative"),
    ):
        assert parser.parse_args(["generate", "x", "--policy", alias]).policy == name
        assert canonical_policy_name(alias) == name
    assert policy_from_description({"policy": "large"}).name == "large_only"
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "x", "--policy", "banana"])
    assert "choose one of ead, small_only, large_only" in capsys.readouterr().err


def test_generate_matches_the_llms_defaults_on_the_embedded_pair(capsys: pytest.CaptureFixture[str]) -> None:
    from ead_llm import EntropyAdaptiveLLM

    assert main(["generate", "4821+3907-1568", "--json"]) == 0  # no newline needed: the pair's format adds it
    out = json.loads(capsys.readouterr().out)
    assert out["text"] == EntropyAdaptiveLLM().invoke("4821+3907-1568\n")
    assert out["text"].endswith("#### 7160\n")


def test_bench_refuses_task_options_without_a_task(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--extractor", "nope"]) == 2
    assert "--extractor applies to a --task file" in capsys.readouterr().err


def test_every_policy_is_reachable_from_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    from ead_llm import EAGER
    from ead_llm.policies.base import _policy_classes
    from ead_llm.serving.cli import POLICY_NAMES, _policy

    families = (
        "ead_llm.policies.base",
        "ead_llm.policies.switching",
        "ead_llm.policies.speculative",
        "ead_llm.policies.eager",
    )
    public = {name for name, cls in _policy_classes().items() if cls.__module__ in families}  # not the controls
    assert public <= set(POLICY_NAMES)
    eager = _policy(build_parser().parse_args(["generate", "x", "--policy", "eager", "--theta", "0.5"]))
    assert eager == EAGER(theta=0.5)
    assert main(["generate", "4821+3907-1568", "--policy", "eager", "--max-paths", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["cost"]["paths"] >= 1 and out["text"]
    assert main(["generate", "x", "--policy", "eager", "--threshold", "1"]) == 2
    assert "--threshold does not apply to --policy eager" in capsys.readouterr().err


def _options(parser) -> list[tuple[str, object]]:
    import argparse

    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return [
        (f"{name} {'/'.join(action.option_strings) or action.dest}", action)
        for name, sub in commands.choices.items()
        for action in sub._actions
        if not isinstance(action, argparse._HelpAction)
    ]


def test_every_option_has_help_and_its_default() -> None:
    from ead_llm.serving.cli import HelpFormatter

    for where, action in _options(build_parser()):
        assert action.help, f"{where} has no help text"
        shown = HelpFormatter("ead-llm")._get_help_string(action)
        is_flag = action.nargs == 0 and not isinstance(action.default, str)
        if action.option_strings and not action.required and not is_flag:
            assert "default" in shown, f"{where}: the help does not say the default"
    wide = {**os.environ, "COLUMNS": "300"}  # argparse wraps at the terminal's width
    bench = [sys.executable, "-m", "ead_llm.serving.cli", "bench", "--help"]
    shown = subprocess.run(bench, capture_output=True, text=True, check=True, env=wide).stdout
    assert "(default: bench-results)" in shown


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["generate", "x", "--max-tokens", "-5"], "max_tokens must be >= 1, got -5"),
        (["generate", "x", "--small", "/no/such/small", "--large", "/no/such/large"], "does not exist"),
        (["generate", "x", "--small", "org/model"], "pass both --small and --large"),
        (["generate", "x", "--policy", "eager", "--theta", "-1"], "theta must be >= 0.0"),
        (["serve", "--port", "70000"], "--port must be in [0, 65535]"),
        (["serve", "--max-request-bytes", "0"], "max_request_bytes must be >= 1"),
        (["demo", "--problems", "0"], "--problems must be >= 1"),
        (["bench", "--dev", "0"], "--dev must be >= 1"),
    ],
)
def test_bad_arguments_are_refused_before_torch_loads(argv: list[str], needle: str) -> None:
    code = (
        "import sys; from ead_llm.serving.cli import main; code = main(sys.argv[1:]); "
        "print(code, sorted(m for m in ('torch', 'transformers', 'langchain_core', 'dspy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "2 []" and needle in out.stderr
