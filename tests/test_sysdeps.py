"""The test-setup step's decisions: which Debian packages it would install for a given set of present ones.

Nothing here installs anything: the decisions are pure functions of what is present.
"""
import pytest

from hrm_edge.errors import UserError
from hrm_edge.verify.sysdeps import NEEDS, apt_command, packages_to_install

ALL = {n.label for n in NEEDS}


def test_nothing_to_install_when_everything_is_present():
    assert packages_to_install(ALL) == []
    assert apt_command([], is_root=False, apt_get=None) == []  # a no-op needs neither root nor apt


def test_bare_machine_gets_every_package_once():
    assert packages_to_install(set()) == ["chromium", "junit4", "libhamcrest-java", "default-jdk-headless",
                                          "nodejs", "npm"]


@pytest.mark.parametrize("absent, expected", [
    ({"/usr/bin/chromium"}, ["chromium"]),
    ({"/usr/share/java/junit4.jar"}, ["junit4"]),
    ({"javac"}, ["default-jdk-headless"]),
    ({"npm"}, ["nodejs", "npm"]),
    ({"/usr/share/java/junit4.jar", "javac"}, ["junit4", "default-jdk-headless"]),
])
def test_only_the_missing_ones(absent, expected):
    assert packages_to_install(ALL - absent) == expected


def test_install_commands():
    cmds = apt_command(["junit4"], is_root=True, apt_get="/usr/bin/apt-get")
    assert cmds == [["/usr/bin/apt-get", "update", "-q"],
                    ["/usr/bin/apt-get", "install", "-y", "-q", "--no-install-recommends", "junit4"]]


def test_not_root_is_one_clear_error():
    with pytest.raises(UserError, match=r"needs root: run `sudo apt-get install chromium junit4`"):
        apt_command(["chromium", "junit4"], is_root=False, apt_get="/usr/bin/apt-get")


def test_no_apt_is_one_clear_error():
    with pytest.raises(UserError, match="apt-get not found"):
        apt_command(["chromium"], is_root=True, apt_get=None)


def test_ci_runs_the_readme_test_command_and_installs_nothing_itself():
    root = __import__("pathlib").Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    commands = [line for line in readme.splitlines() if line.startswith("pip install ") and "pytest" in line]
    assert len(commands) == 1 and "python -m hrm_edge.sysdeps" in commands[0], commands
    ci = (root / ".ci" / "run").read_text()
    assert commands[0] in ci.splitlines()
    assert "apt-get" not in ci
