"""The README stays true: its curl example runs as written against a real server."""

from __future__ import annotations

import json
import re
import subprocess

from tests.conftest import REPO
from tests.server import ServerProcess


def test_the_readme_curl_example_runs_as_written(server: ServerProcess) -> None:
    readme = (REPO / "README.md").read_text()
    blocks = re.findall(r"```sh\n(curl -s localhost:8000/v2/models/digits/infer.*?)```", readme,
                        re.S)  # fmt: skip
    assert len(blocks) == 1
    command = blocks[0].replace("localhost:8000", f"127.0.0.1:{server.port}")
    assert "..." not in command
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, check=True)
    answer = json.loads(done.stdout)
    assert answer["outputs"] == [{"name": "label", "datatype": "INT64", "shape": [1], "data": [7]}]
    shown = re.search(r'```json\n(\{"model_name":"digits".*?)\n```', readme)
    assert shown is not None
    assert json.loads(shown.group(1)) == answer


def test_the_default_profile_points_to_sections_that_exist() -> None:
    readme = (REPO / "README.md").read_text()
    profile = (REPO / "profiles" / "default.toml").read_text()
    for section in re.findall(r'README "([^"]+)"', profile):
        assert f"## {section}\n" in readme, section
