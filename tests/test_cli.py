"""The ``kvcache`` console script dispatches to the daemon, the benchmarks and the demo."""

from __future__ import annotations

import pytest

from kvcache.cli import COMMANDS, main


def test_no_command_prints_usage_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    out = capsys.readouterr().out
    assert all(name in out for name in COMMANDS)


def test_unknown_command_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve"]) == 2
    assert "unknown command 'serve'" in capsys.readouterr().err


def test_server_help_names_the_console_script(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["server", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: kvcache server") and "--l2-disk-path" in out


def test_bench_and_demo_forward_their_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--help"]) == 0
    assert "daemon" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        main(["demo", "--help"])
    assert info.value.code == 0
    assert "--keep-running" in capsys.readouterr().out
