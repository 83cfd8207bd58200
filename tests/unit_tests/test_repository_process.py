# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Checks of the repository process files: GitHub workflows, copy-pr-bot, CODEOWNERS, templates.

GitHub only reports a broken workflow when it runs, and a GPU workflow runs only after a
maintainer's ``/ok to test``; these tests catch the usual mistakes on every CPU CI run instead:
YAML that GitHub would reject, a job that calls a script that does not exist, a GPU workflow that
untrusted pull requests could start, and a functional-test matrix that has drifted from the cases
under ``tests/functional_tests/test_cases``.
"""

import re
import shlex
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Set, Tuple

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = None

REPO_ROOT = Path(__file__).resolve().parents[2]
GITHUB_DIR = REPO_ROOT / ".github"
WORKFLOWS_DIR = GITHUB_DIR / "workflows"
CPU_WORKFLOW = WORKFLOWS_DIR / "cpu-tests.yml"
GPU_WORKFLOW = WORKFLOWS_DIR / "gpu-tests.yml"
CASES_ROOT = REPO_ROOT / "tests" / "functional_tests" / "test_cases"
FUNCTIONAL_RUNNER = "tests/functional_tests/python_test_utils/run_functional_case.py"
GPU_SUITE = "scripts/run_gpu_suite.sh"
GPU_MATRIX = "scripts/run_gpu_matrix.sh"
LINT_SCRIPT = "scripts/lint.sh"
DETERMINISM_MANIFEST = "tests/unit_tests/determinism/kernels/manifest.py"

# GPU job ids in gpu-tests.yml. Cases whose model_config.yaml sets NPROC >= 2 belong to the
# multi-GPU job, all others to the single-GPU one.
SINGLE_GPU_FUNCTIONAL_JOB = "functional"
MULTI_GPU_FUNCTIONAL_JOB = "functional-multi-gpu"
GPU_UNIT_JOB = "gpu-unit-tests"
TRITON_MATRIX_JOB = "triton-matrix"
# The platform tag of the golden values the GPU runners compare with (golden_values_<env>_<platform>
# .json); it follows the runner labels (gpu-h200-*).
GOLDEN_PLATFORM = "h200"

# (megatron-core, Python) pairs the GPU unit-test matrix must cover: every supported megatron-core
# release on each Python it installs on (0.19.x needs Python >= 3.12).
SUPPORTED_GPU_MATRIX = {("0.16.1", "3.11"), ("0.16.1", "3.12"), ("0.19.2", "3.12")}

# Commands whose first argument is a repository file when it is a path.
_SCRIPT_RUNNERS = re.compile(r"^(bash|sh|source|\.|python(3(\.\d+)?)?)$")
_EXPRESSION = re.compile(r"\$\{\{.*?\}\}")


def _load_yaml(path: Path) -> Any:
    """Parses one YAML file.

    Args:
        path: the file.

    Returns:
        The parsed document.
    """
    with path.open(encoding="utf-8") as handle:
        return yaml.safe_load(handle)


def _workflow_files() -> List[Path]:
    """Returns the workflow files GitHub would load, sorted by name."""
    return sorted(p for p in WORKFLOWS_DIR.glob("*") if p.suffix in (".yml", ".yaml"))


def _triggers(workflow: Dict[Any, Any]) -> Dict[str, Any]:
    """Returns a workflow's ``on:`` section as a mapping from event name to its settings.

    PyYAML reads the bare key ``on`` as the boolean True (YAML 1.1), so both spellings are looked
    up. A single event (``on: push``) and a list of events are normalised to a mapping.

    Args:
        workflow: the parsed workflow.

    Returns:
        Event name -> settings (None where the event has none).
    """
    on = workflow.get("on", workflow.get(True))
    if isinstance(on, str):
        return {on: None}
    if isinstance(on, list):
        return {event: None for event in on}
    return dict(on or {})


def _jobs(workflow: Dict[Any, Any]) -> Dict[str, Dict[str, Any]]:
    """Returns a workflow's jobs (an empty mapping when it has none)."""
    jobs = workflow.get("jobs")
    return jobs if isinstance(jobs, dict) else {}


def _run_blocks(job: Dict[str, Any]) -> List[str]:
    """Returns the ``run:`` scripts of a job's steps, in order."""
    return [step["run"] for step in job.get("steps") or [] if isinstance(step.get("run"), str)]


def _command_lines(script: str) -> Iterator[List[str]]:
    """Splits a ``run:`` script into shell-like token lists, one per logical line.

    ``${{ ... }}`` expressions become a single opaque token, line continuations are joined, and
    lines chained with ``&&``, ``||`` or ``;`` are split into their commands.

    Args:
        script: the text of a ``run:`` key.

    Yields:
        The tokens of each simple command.
    """
    script = _EXPRESSION.sub("__expr__", script).replace("\\\n", " ")
    for line in script.splitlines():
        line = line.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        for command in re.split(r"&&|\|\||;|\|", line):
            try:
                tokens = shlex.split(command)
            except ValueError:
                tokens = command.split()
            if tokens:
                yield tokens


def _script_references(script: str) -> Set[str]:
    """Returns the repository paths a ``run:`` script executes (``bash X``, ``python X``, ...).

    Arguments that are options, modules (``python -m``), inline code (``python -c``) or contain a
    variable or an expression are not paths of the repository and are skipped.

    Args:
        script: the text of a ``run:`` key.

    Returns:
        Paths relative to the repository root.
    """
    paths = set()
    for tokens in _command_lines(script):
        for runner, argument in zip(tokens, tokens[1:]):
            if not _SCRIPT_RUNNERS.match(runner) or argument.startswith("-"):
                continue
            if "$" in argument or "__expr__" in argument:
                continue
            paths.add(argument)
    return paths


def _matrix_values(job: Dict[str, Any], key: str) -> List[Any]:
    """Returns the values a job's matrix gives ``key``, from the axis and from ``include``.

    Args:
        job: the job.
        key: the matrix variable.

    Returns:
        The values, in file order, duplicates kept.
    """
    matrix = (job.get("strategy") or {}).get("matrix") or {}
    values = list(matrix.get(key) or [])
    values += [entry[key] for entry in matrix.get("include") or [] if key in entry]
    return values


def _matrix_combinations(job: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Expands a job's matrix into its combinations, the way GitHub does for simple matrices.

    The product of the axes, minus the combinations an ``exclude`` entry matches, plus the
    ``include`` entries that set every axis (those that only add keys are ignored).

    Args:
        job: the job.

    Returns:
        One mapping of matrix variable -> value per combination.
    """
    matrix = dict((job.get("strategy") or {}).get("matrix") or {})
    include = matrix.pop("include", None) or []
    exclude = matrix.pop("exclude", None) or []
    combinations = [{}]
    for key, values in matrix.items():
        combinations = [{**c, key: value} for c in combinations for value in values]
    if not matrix:
        combinations = []
    combinations = [
        c
        for c in combinations
        if not any(all(c.get(k) == v for k, v in e.items()) for e in exclude)
    ]
    combinations += [dict(entry) for entry in include if set(matrix) <= set(entry)]
    return combinations


def _find_key(document: Any, key: str) -> Optional[Any]:
    """Returns the first value of ``key`` anywhere in a nested YAML document, or None."""
    if isinstance(document, dict):
        if key in document:
            return document[key]
        children = list(document.values())
    elif isinstance(document, list):
        children = document
    else:
        return None
    for child in children:
        found = _find_key(child, key)
        if found is not None:
            return found
    return None


def _functional_cases() -> Dict[str, int]:
    """Discovers the functional test cases and the number of GPUs each needs.

    Returns:
        Case id (its directory relative to ``tests/functional_tests/test_cases``, e.g.
        ``gpt/some_case``) -> ``GPUS`` of its model_config.yaml (default ``NPROC``, 1 when
        both are absent).
    """
    cases = {}
    if not CASES_ROOT.is_dir():
        return cases
    for config in sorted(CASES_ROOT.rglob("model_config.yaml")):
        raw = _load_yaml(config) or {}
        gpus = _find_key(raw, "GPUS") or _find_key(raw, "NPROC")
        cases[config.parent.relative_to(CASES_ROOT).as_posix()] = int(gpus or 1)
    return cases


def _pyproject() -> Dict[str, Any]:
    """Returns pyproject.toml, parsed (skips the test where tomllib is missing)."""
    if tomllib is None:
        pytest.skip("tomllib needs Python >= 3.11")
    with (REPO_ROOT / "pyproject.toml").open("rb") as handle:
        return tomllib.load(handle)


def _lint_pins() -> Dict[str, str]:
    """Returns the ``lint`` extra of pyproject.toml as package name -> pinned version."""
    pins = {}
    for text in _pyproject()["project"]["optional-dependencies"]["lint"]:
        requirement = Requirement(text)
        (specifier,) = requirement.specifier
        assert specifier.operator == "==", f"lint extra: pin {text!r} exactly (==)"
        pins[requirement.name.lower()] = specifier.version
    return pins


def _pins_in(texts: List[str], names: Set[str]) -> Set[Tuple[str, str]]:
    """Returns the exact pins of the named packages that occur in some texts.

    Args:
        texts: shell commands or requirement strings.
        names: package names to look for.

    Returns:
        (name, version) pairs.
    """
    found = set()
    for text in texts:
        for name, version in re.findall(r"([A-Za-z0-9_.-]+)==([A-Za-z0-9_.+-]+)", text):
            if name.lower() in names:
                found.add((name.lower(), version))
    return found


WORKFLOWS = _workflow_files()


def test_the_workflows_exist():
    names = {path.name for path in WORKFLOWS}
    assert {CPU_WORKFLOW.name, GPU_WORKFLOW.name} <= names, f"found {sorted(names)}"


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_workflow_has_the_keys_github_requires(path: Path):
    workflow = _load_yaml(path)
    assert isinstance(workflow, dict), f"{path.name}: not a mapping"
    assert _triggers(workflow), f"{path.name}: no `on:` triggers"
    jobs = _jobs(workflow)
    assert jobs, f"{path.name}: no `jobs:`"
    for job_id, job in jobs.items():
        where = f"{path.name}: job {job_id!r}"
        assert isinstance(job, dict), f"{where}: not a mapping"
        if "uses" in job:  # a call of a reusable workflow
            assert "steps" not in job, f"{where}: has both `uses` and `steps`"
            continue
        assert job.get("runs-on"), f"{where}: no `runs-on`"
        steps = job.get("steps")
        assert isinstance(steps, list) and steps, f"{where}: no `steps`"
        for index, step in enumerate(steps):
            assert isinstance(step, dict), f"{where}: step {index} is not a mapping"
            kinds = [key for key in ("run", "uses") if key in step]
            assert len(kinds) == 1, f"{where}: step {index} needs one of `run`/`uses`: {kinds}"
        needs = job.get("needs") or []
        for need in [needs] if isinstance(needs, str) else needs:
            assert need in jobs, f"{where}: needs unknown job {need!r}"


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_workflow_runs_only_scripts_that_exist(path: Path):
    missing = []
    for job_id, job in _jobs(_load_yaml(path)).items():
        for script in _run_blocks(job):
            for reference in sorted(_script_references(script)):
                if not (REPO_ROOT / reference).is_file():
                    missing.append(f"job {job_id!r} runs {reference}")
        for step in job.get("steps") or []:
            uses = step.get("uses", "")
            if uses.startswith("./") and not (REPO_ROOT / uses).exists():
                missing.append(f"job {job_id!r} uses {uses}")
    assert not missing, f"{path.name}: missing in the repository: " + "; ".join(missing)


def test_script_reference_parser():
    script = (
        'python -m pip install "black==1"\n'
        "bash scripts/a.sh --x 1 && python tools/b.py \\\n  --case \"${{ matrix.case }}\"\n"
        'python "$DIR/c.py"\n'
        "python3.12 -c 'print(1)'\n"
        "# bash commented.sh\n"
    )
    assert _script_references(script) == {"scripts/a.sh", "tools/b.py"}


def test_matrix_expansion():
    job = {
        "strategy": {
            "matrix": {
                "mcore": ["a", "b"],
                "case": ["x", "y"],
                "exclude": [{"mcore": "b", "case": "y"}],
                "include": [{"mcore": "c", "case": "z"}, {"case": "x", "extra": 1}],
            }
        }
    }
    pairs = {(c["mcore"], c["case"]) for c in _matrix_combinations(job)}
    assert pairs == {("a", "x"), ("a", "y"), ("b", "x"), ("c", "z")}


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_self_hosted_runners_are_not_reachable_from_untrusted_pull_requests(path: Path):
    workflow = _load_yaml(path)
    self_hosted = [
        job_id
        for job_id, job in _jobs(workflow).items()
        if "self-hosted" in str(job.get("runs-on", ""))
    ]
    if not self_hosted:
        return
    unsafe = {"pull_request", "pull_request_target", "issue_comment"} & set(_triggers(workflow))
    assert not unsafe, (
        f"{path.name}: jobs {self_hosted} run on self-hosted runners but the workflow is "
        f"triggered by {sorted(unsafe)}; GPU jobs must start only from copy-pr-bot's "
        "pull-request/<N> branches (after `/ok to test`) or by hand"
    )


def test_gpu_workflow_is_triggered_by_copy_pr_bot_branches():
    triggers = _triggers(_load_yaml(GPU_WORKFLOW))
    branches = (triggers.get("push") or {}).get("branches") or []
    assert "pull-request/[0-9]+" in branches, f"push branches are {branches}"
    assert "workflow_dispatch" in triggers
    assert not {"pull_request", "pull_request_target"} & set(triggers)


def test_cpu_workflow_runs_lint_and_the_ci_entry_point_on_pull_requests():
    workflow = _load_yaml(CPU_WORKFLOW)
    assert "pull_request" in _triggers(workflow)
    scripts = set()
    for job in _jobs(workflow).values():
        assert "self-hosted" not in str(job.get("runs-on")), "CPU jobs run on GitHub's runners"
        for block in _run_blocks(job):
            scripts |= _script_references(block)
    assert {".ci/run", LINT_SCRIPT} <= scripts, f"CPU workflow runs {sorted(scripts)}"


def test_gpu_unit_matrix_covers_the_supported_megatron_core_releases():
    job = _jobs(_load_yaml(GPU_WORKFLOW))[GPU_UNIT_JOB]
    assert any(GPU_SUITE in _script_references(block) for block in _run_blocks(job))
    pairs = set(
        zip(map(str, _matrix_values(job, "mcore")), map(str, _matrix_values(job, "python")))
    )
    assert pairs == SUPPORTED_GPU_MATRIX, f"matrix has {sorted(pairs)}"

    project = _pyproject()["project"]
    (mcore_requirement,) = [
        Requirement(text)
        for text in project["dependencies"]
        if Requirement(text).name == "megatron-core"
    ]
    requires_python = SpecifierSet(project["requires-python"])
    for mcore, python in pairs:
        assert Version(mcore) in mcore_requirement.specifier, f"{mcore} outside pyproject's range"
        assert Version(python) in requires_python, f"Python {python} outside requires-python"


def _readme_tritons() -> List[str]:
    """The Triton releases the README's support matrix lists: the rows of its table whose first
    column is headed ``Triton``."""
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Support matrix", 1)[1].split("\n## ", 1)[0]
    table = section.split("\n| Triton |", 1)[1].split("\n\n", 1)[0]
    return re.findall(r"^\| (\d+\.\d+\.\d+) \|", table, flags=re.M)


def test_triton_matrix_runs_every_triton_the_readme_lists():
    job = _jobs(_load_yaml(GPU_WORKFLOW))[TRITON_MATRIX_JOB]
    blocks = _run_blocks(job)
    matrix_runs = [b for b in blocks if GPU_MATRIX in _script_references(b)]
    assert matrix_runs, f"job {TRITON_MATRIX_JOB!r} must run {GPU_MATRIX}"
    assert all("${{ matrix.triton }}" in b for b in matrix_runs), "one Triton per job"
    tritons = list(map(str, _matrix_values(job, "triton")))
    claimed = _readme_tritons()
    assert len(claimed) >= 2, f"README support matrix lists Tritons {claimed}"
    assert sorted(tritons) == sorted(set(claimed)) and len(tritons) == len(set(tritons)), (
        f"{GPU_WORKFLOW.name} jobs.{TRITON_MATRIX_JOB} runs Tritons {tritons}; "
        f"the README claims {claimed}"
    )
    prepare = [b for b in blocks if "prepare_gpu_env.sh" in b]
    assert prepare and all("--triton" in b for b in prepare), "each row installs its Triton"


def _matrix_mismatch(job_id: str, listed: List[str], expected: Set[str]) -> Optional[str]:
    """Compares a functional job's matrix with the cases discovered in the tree.

    Args:
        job_id: the job in gpu-tests.yml.
        listed: the cases its matrix lists.
        expected: the cases it should list.

    Returns:
        None when the matrix lists exactly the expected cases, once each; otherwise a message
        naming the cases to add, to remove and listed twice.
    """
    duplicates = sorted({case for case in listed if listed.count(case) > 1})
    add = sorted(expected - set(listed))
    remove = sorted(set(listed) - expected)
    if not (add or remove or duplicates):
        return None
    return (
        f"jobs.{job_id}.strategy.matrix.case: add {add}, remove {remove}, "
        f"listed twice {duplicates}"
    )


def test_functional_matrices_list_exactly_the_cases_in_the_tree():
    jobs = _jobs(_load_yaml(GPU_WORKFLOW))
    cases = _functional_cases()
    expected = {
        SINGLE_GPU_FUNCTIONAL_JOB: {case for case, gpus in cases.items() if gpus < 2},
        MULTI_GPU_FUNCTIONAL_JOB: {case for case, gpus in cases.items() if gpus >= 2},
    }
    problems = []
    for job_id, wanted in expected.items():
        job = jobs.get(job_id)
        if job is None:
            if job_id == SINGLE_GPU_FUNCTIONAL_JOB or wanted:
                problems.append(f"no job {job_id!r} for the cases {sorted(wanted)}")
            continue
        if not any(FUNCTIONAL_RUNNER in _script_references(b) for b in _run_blocks(job)):
            problems.append(f"job {job_id!r} does not run {FUNCTIONAL_RUNNER}")
        if job_id == MULTI_GPU_FUNCTIONAL_JOB:
            if str((job.get("env") or {}).get("NCCL_NVLS_ENABLE")) != "0":
                problems.append(f"job {job_id!r} must set env NCCL_NVLS_ENABLE: '0'")
        mismatch = _matrix_mismatch(job_id, _matrix_values(job, "case"), wanted)
        if mismatch:
            problems.append(mismatch)
    assert not problems, (
        f"{GPU_WORKFLOW.relative_to(REPO_ROOT)} is out of sync with the functional cases "
        f"({CASES_ROOT.relative_to(REPO_ROOT)}/**/model_config.yaml; GPUS (default NPROC) >= 2 "
        f"goes to {MULTI_GPU_FUNCTIONAL_JOB!r}): " + "; ".join(problems)
    )


def test_every_functional_job_has_its_golden_values():
    jobs = _jobs(_load_yaml(GPU_WORKFLOW))
    missing = []
    for job_id in (SINGLE_GPU_FUNCTIONAL_JOB, MULTI_GPU_FUNCTIONAL_JOB):
        for combination in _matrix_combinations(jobs.get(job_id) or {}):
            case_dir = CASES_ROOT / str(combination["case"])
            config_path = case_dir / "model_config.yaml"
            if not config_path.is_file():
                continue  # reported by the matrix test
            config = _load_yaml(config_path) or {}
            if str(config.get("GOLDEN", "bitwise")) == "none":
                continue
            # A case no machine of its size has run yet says so; the runner still fails it
            # there until its golden values are generated.
            if str(config.get("GOLDEN_PENDING") or "").strip():
                continue
            major, minor = Version(str(combination["mcore"])).release[:2]
            golden = case_dir / f"golden_values_mcore-{major}.{minor}_{GOLDEN_PLATFORM}.json"
            if not golden.is_file():
                missing.append(str(golden.relative_to(REPO_ROOT)))
    assert not missing, (
        f"{GPU_WORKFLOW.relative_to(REPO_ROOT)} runs functional cases without golden values; "
        "generate them on the GPU with run_functional_case.py --generate-golden, or exclude "
        f"the (case, mcore) pair from the job's matrix. Missing: {sorted(missing)}"
    )


# The tool each pre-commit hook runs (its entry's first word) -> the package of the `lint` extra
# that installs it (None: the system's own).
_HOOK_TOOLS = {
    "black": "black",
    "isort": "isort",
    "ruff": "ruff",
    "check-yaml": "pre-commit-hooks",
    "trailing-whitespace-fixer": "pre-commit-hooks",
    "end-of-file-fixer": "pre-commit-hooks",
    "bash": None,
}


def test_pre_commit_hooks_run_offline_with_the_lint_extras_tools():
    """pre-commit fetches remote hook repositories and the environments of ``language: python``
    hooks from the network; CI reaches only the package index. Every hook is local and runs a
    tool the `lint` extra pins."""
    pins = _lint_pins()
    assert {"pre-commit", "pre-commit-hooks"} <= set(pins)
    config = _load_yaml(REPO_ROOT / ".pre-commit-config.yaml")
    problems = []
    for repo in config["repos"]:
        if repo["repo"] != "local":
            problems.append(f"repo {repo['repo']} is fetched from the network")
        for hook in repo.get("hooks", []):
            if hook.get("language") not in ("system", "unsupported"):
                problems.append(f"{hook['id']}: language {hook.get('language')!r} installs its own")
            if hook.get("additional_dependencies"):
                problems.append(f"{hook['id']}: additional_dependencies are downloaded")
            tool = shlex.split(hook["entry"])[0]
            if tool not in _HOOK_TOOLS:
                problems.append(f"{hook['id']}: runs {tool!r}, which no lint pin provides")
            elif _HOOK_TOOLS[tool] is not None and _HOOK_TOOLS[tool] not in pins:
                problems.append(f"{hook['id']}: {_HOOK_TOOLS[tool]} is not in the lint extra")
    assert not problems, ".pre-commit-config.yaml: " + "; ".join(problems)


def test_lint_script_runs_the_pre_commit_hooks():
    text = (REPO_ROOT / LINT_SCRIPT).read_text(encoding="utf-8")
    assert re.search(r"-m pre_commit run --all-files", text), f"{LINT_SCRIPT} must run the hooks"


def test_workflows_install_the_lint_extras_pins():
    pins = _lint_pins()
    expected = set(pins.items())
    names = set(pins)
    for path in WORKFLOWS:
        blocks = [b for job in _jobs(_load_yaml(path)).values() for b in _run_blocks(job)]
        found = _pins_in(blocks, names)
        assert found <= expected, f"{path.name} installs {sorted(found - expected)}"
    lint_job = _jobs(_load_yaml(CPU_WORKFLOW))["lint"]
    installed = _pins_in(_run_blocks(lint_job), names)
    assert (
        installed == expected
    ), f"the lint job installs {sorted(installed)}, not {sorted(expected)}"


def test_ci_entry_point_runs_the_lint_script():
    text = (REPO_ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert LINT_SCRIPT in _script_references(text)
    assert (REPO_ROOT / LINT_SCRIPT).is_file()


def test_ci_entry_point_uses_a_fresh_virtual_environment_per_run():
    """Two runs on one machine must not share (and overwrite) one environment."""
    text = (REPO_ROOT / ".ci" / "run").read_text(encoding="utf-8")
    made = re.search(r'^venv="\$\(mktemp -d [^)]*\)"$', text, flags=re.M)
    assert made, ".ci/run must make its virtual environment with mktemp -d"
    assert re.search(r"""^trap 'rm -rf "\$venv"' EXIT$""", text, flags=re.M), "and remove it"


def test_copy_pr_bot_configuration():
    config = _load_yaml(GITHUB_DIR / "copy-pr-bot.yaml")
    assert config["enabled"] is True
    assert config["auto_sync_draft"] is False
    assert config["auto_sync_ready"] is True
    trustees = config.get("trustees_override") or config.get("additional_trustees")
    assert isinstance(trustees, list) and trustees, "list the trusted GitHub users"


def test_codeowners_lines_are_well_formed_and_point_at_existing_paths():
    path = REPO_ROOT / "CODEOWNERS"
    assert path.is_file(), "CODEOWNERS belongs at the repository root"
    problems = []
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        pattern, *owners = line.split()
        if not owners or not all(re.fullmatch(r"@[\w.-]+(/[\w.-]+)?", o) for o in owners):
            problems.append(f"line {number}: owners must be @org/team or @user: {raw!r}")
        if not any(ch in pattern for ch in "*?[") and pattern != "/":
            if not (REPO_ROOT / pattern.strip("/")).exists():
                problems.append(f"line {number}: {pattern} does not exist")
    assert not problems, "CODEOWNERS: " + "; ".join(problems)


def test_pull_request_template_has_the_pre_checks():
    text = (GITHUB_DIR / "pull_request_template.md").read_text(encoding="utf-8")
    assert text.count("- [ ]") >= 5
    for needle in (DETERMINISM_MANIFEST, "/ok to test", "functional test", "benchmark"):
        assert needle.lower() in text.lower(), f"pull_request_template.md lacks {needle!r}"


@pytest.mark.parametrize("name", ["bug_report.md", "feature_request.md", "regression.md"])
def test_issue_templates_have_front_matter(name: str):
    text = (GITHUB_DIR / "ISSUE_TEMPLATE" / name).read_text(encoding="utf-8")
    assert text.startswith("---\n")
    front_matter = yaml.safe_load(text.split("---\n")[1])
    assert front_matter.get("name") and front_matter.get("about")


def test_contributing_guide_covers_the_process():
    text = (REPO_ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8")
    for needle in (
        "/ok to test",
        GPU_SUITE,
        "--generate-golden",
        DETERMINISM_MANIFEST,
        LINT_SCRIPT,
    ):
        assert needle in text, f"CONTRIBUTING.md lacks {needle!r}"


# ----------------------------------------------------------------------------------------------
# The install: constraints, pyproject.toml, the README and the fresh-resolve job agree


FRESH_RESOLVE_JOB = "fresh-resolve"
RESOLVE_SCRIPT = ".github/scripts/resolve_readme_install.py"
# Where a PyPI-only machine would differ from CI: settings that add an index or local wheels.
_EXTRA_SOURCES = ("PIP_EXTRA_INDEX_URL", "PIP_INDEX_URL", "PIP_FIND_LINKS", "--extra-index-url")


def _readme_constraints_file() -> Path:
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    files = set(re.findall(r"pip install -c (\S+)", readme.split("## Quick start", 1)[1]))
    assert len(files) == 1, f"the quick start names constraint files {sorted(files)}"
    return REPO_ROOT / files.pop()


def _constraints() -> Dict[str, Requirement]:
    lines = _readme_constraints_file().read_text(encoding="utf-8").splitlines()
    requirements = [Requirement(line) for line in lines if line.strip() and line[0] != "#"]
    return {r.name: r for r in requirements}


def _claimed_pythons() -> List[str]:
    """The Python versions the README claims (its quick start's "Python 3.X-3.Y")."""
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    low, high = re.search(
        r"Python 3\.(\d+)-3\.(\d+)", readme.split("## Quick start", 1)[1]
    ).groups()
    return [f"3.{minor}" for minor in range(int(low), int(high) + 1)]


def test_claimed_pythons_agree_with_pyproject():
    project = _pyproject()["project"]
    claimed = _claimed_pythons()
    classifiers = {
        c.rsplit(" :: ", 1)[1]
        for c in project["classifiers"]
        if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)
    }
    assert classifiers == set(claimed)
    requires = SpecifierSet(project["requires-python"])
    assert all(Version(v) in requires for v in claimed)
    assert Version(f"3.{int(claimed[0][2:]) - 1}") not in requires
    assert Version(f"3.{int(claimed[-1][2:]) + 1}") not in requires


def test_constraint_pins_agree_with_pyproject_and_the_support_matrix():
    from megatron_ext.package_info import MAX_MCORE_VERSION_EXCLUSIVE, MIN_MCORE_VERSION

    constraints = _constraints()
    dependencies = {
        Requirement(text).name: Requirement(text)
        for text in _pyproject()["project"]["dependencies"]
    }
    assert {"torch", "triton", "megatron-core"} <= set(constraints)
    assert set(constraints) <= set(dependencies), "constrain only the package's dependencies"
    for name in ("torch", "megatron-core"):
        (spec,) = constraints[name].specifier
        assert spec.operator == "==", f"{name}: pin one release (==)"
    for name, requirement in constraints.items():
        # Every release the constraint admits that is named in it must satisfy pyproject.toml.
        for spec in requirement.specifier:
            version = Version(spec.version)
            if spec.operator in ("==", ">=") and version in requirement.specifier:
                assert version in dependencies[name].specifier, f"{name} {version} vs pyproject"
    (mcore,) = constraints["megatron-core"].specifier
    assert (
        Version(MIN_MCORE_VERSION) <= Version(mcore.version) < Version(MAX_MCORE_VERSION_EXCLUSIVE)
    )
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    tested_in_ci = re.search(r"^\| ([0-9.]+) \| [^|]* \| tested: CPU in CI", readme, flags=re.M)
    assert tested_in_ci and tested_in_ci.group(1) == mcore.version


def test_fresh_resolve_job_resolves_the_readme_on_every_claimed_python_from_pypi_alone():
    workflow = _load_yaml(CPU_WORKFLOW)
    job = _jobs(workflow)[FRESH_RESOLVE_JOB]
    assert "pull_request" in _triggers(workflow)
    assert sorted(map(str, _matrix_values(job, "python-version"))) == _claimed_pythons()
    setup = [s for s in job["steps"] if str(s.get("uses", "")).startswith("actions/setup-python")]
    assert setup and setup[0]["with"]["python-version"] == "${{ matrix.python-version }}"
    assert any(RESOLVE_SCRIPT in _script_references(block) for block in _run_blocks(job))
    text = str(job) + str(workflow.get("env", {}))
    for source in _EXTRA_SOURCES:
        assert source not in text, f"the fresh-resolve job must not use {source}"


def test_resolve_script_reads_both_readme_install_commands():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "resolve_readme_install", REPO_ROOT / RESOLVE_SCRIPT
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    commands = module.readme_install_commands((REPO_ROOT / "README.md").read_text(encoding="utf-8"))
    constraint = str(_readme_constraints_file().relative_to(REPO_ROOT))
    assert [c[c.index("-e") + 1] for c in commands] == [".[bench]", ".[test]"]
    assert all(c[c.index("-c") + 1] == constraint for c in commands)
    with pytest.raises(ValueError, match="no `python3 -m pip install`"):
        module.readme_install_commands("## Quick start\n\n```bash\nls\n```\n")
