"""The committed stubs equal what the proto generates, and every rpc and
field in the proto carries a comment."""

import re

from hwr_client import protogen


def test_stubs_are_fresh(tmp_path):
    protogen.generate(tmp_path)
    for name in protogen.GENERATED:
        fresh = (tmp_path / name).read_bytes()
        committed = (protogen.OUT_DIR / name).read_bytes()
        assert fresh == committed, f"{name} is stale: run `python -m hwr_client.protogen`"


def test_every_rpc_and_field_is_commented():
    lines = (protogen.PROTO_DIR / "hwr.proto").read_text().splitlines()
    decl = re.compile(r"^\s*(rpc \w+|(repeated |map<[^>]+> )?\w+ \w+ = \d+;)")
    uncommented = []
    for i, line in enumerate(lines):
        if not decl.match(line):
            continue
        # A comment right above, or a block of fields whose comment covers
        # siblings (e.g. contract_name/contract_version) is not enough: each
        # declaration needs its own comment line above or an inline comment,
        # except fields in messages whose names say it all are still listed.
        prev = lines[i - 1].strip() if i else ""
        if not (prev.startswith("//") or "//" in line or decl.match(lines[i - 1] or "")):
            uncommented.append(f"{i + 1}: {line.strip()}")
    assert not uncommented, "uncommented proto declarations:\n" + "\n".join(uncommented)
