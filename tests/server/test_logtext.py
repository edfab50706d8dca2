"""hwr_server.logtext: what a client- or registry-supplied string looks like
in a daemon log line (one line, unambiguous, formatted only when emitted)."""

from __future__ import annotations

import logging

from hwr_server.logtext import MAX_CHARS, escape, untrusted


def test_control_characters_separators_and_backslash_are_escaped():
    text = "a\nb\rc\td\x00e\x1b[31mf\x7fg\x85h\u2028i\u2029j\\k é 中"
    assert escape(text) == "a\\nb\\rc\\td\\x00e\\x1b[31mf\\x7fg\\x85h\\u2028i\\u2029j\\\\k é 中"
    assert "\n" not in escape("\n" * 10) and escape("") == ""
    # Unambiguous: a literal backslash-n and a newline read differently.
    assert escape("\\n") != escape("\n")


def test_long_values_are_cut_with_the_count():
    assert escape("x" * (MAX_CHARS + 5)) == "x" * MAX_CHARS + "…(+5 chars)"


def test_untrusted_formats_only_when_emitted(caplog):
    class Loud:
        calls = 0

        def __str__(self) -> str:
            Loud.calls += 1
            return "line\nFORGED"

    log = logging.getLogger("hwr_server.test_logtext")
    with caplog.at_level(logging.INFO, logger=log.name):
        log.debug("dropped %s", untrusted(Loud()))
        assert Loud.calls == 0
        log.info("kept %s", untrusted(Loud()))
    assert Loud.calls >= 1  # formatted by the handlers that emit it
    assert caplog.records[-1].getMessage() == "kept line\\nFORGED"
