"""yamllint, with deploy/.yamllint, passes on every YAML file under deploy/."""

from __future__ import annotations

from yamllint import linter
from yamllint.config import YamlLintConfig

from .inventory import DEPLOY, yaml_files


def test_yamllint_passes_on_every_yaml_file() -> None:
    config = YamlLintConfig(file=str(DEPLOY / ".yamllint"))
    files = yaml_files()
    assert len(files) >= 25 and any(f.name == "kustomization.yaml" for f in files)
    problems = [f"{path.relative_to(DEPLOY)}:{problem.line}:{problem.column}: {problem.desc} ({problem.rule})"
                for path in files for problem in linter.run(path.read_text(), config, str(path))]
    assert not problems, "\n".join(problems)


def test_yamllint_catches_a_badly_indented_manifest() -> None:
    config = YamlLintConfig(file=str(DEPLOY / ".yamllint"))
    problems = list(linter.run("apiVersion: v1\nkind: Namespace\nmetadata:\n    name: x\n", config))
    assert [p.rule for p in problems] == ["indentation"]
