"""docs/configuration.md is generated from the config dataclasses and the services' parsers,
and stays current: a new field or flag without its doc fails here."""

import argparse

from tessera import config_doc


def test_the_configuration_reference_is_current() -> None:
    assert config_doc.main(["--check"]) == 0, "run: python -m tessera.config_doc"


def test_every_config_field_has_a_doc_comment() -> None:
    assert config_doc.undocumented_fields() == []


def test_every_service_flag_has_help() -> None:
    missing = [
        f"{title} {action.option_strings[0]}"
        for title, build in config_doc.parsers()
        for action in build()._actions
        if action.option_strings
        and not isinstance(action, argparse._HelpAction)
        and not action.help
    ]
    assert missing == []


def test_a_field_comment_reaches_the_reference() -> None:
    text = config_doc.render()
    row = next(line for line in text.splitlines() if line.startswith("| `block_size` |"))
    assert "`16`" in row and "Tokens per KV block" in row
