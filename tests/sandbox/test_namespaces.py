"""The ``unshare`` backend's own namespaces and private root (``carton._sandbox._namespaces``), through the shim.

These run the shim directly, without Landlock or seccomp, so what they see is the mount view alone: only the
allow-list is there, read-only where it should be, under a fresh PID namespace and an unprivileged uid.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from carton._sandbox import Backend, machine_support
from carton._sandbox._layers import SHIM, fresh_uid
from carton._sandbox._namespaces import SANDBOX_ID, _inside, namespace_config
from carton._sandbox._paths import import_roots, system_paths
from carton._sandbox._shim import SETUP_FAILED

UNSHARE_PROBLEM = machine_support().backends[Backend.UNSHARE]
needs_unshare = pytest.mark.skipif(UNSHARE_PROBLEM is not None, reason=f"unshare backend: {UNSHARE_PROBLEM}")

#: Prints one JSON object describing the view from inside.
LOOK = textwrap.dedent(
    """
    import json, os, socket, sys
    def attempt(action):
        try:
            action()
            return "ok"
        except OSError as exc:
            return exc.strerror
    ro, rw = sys.argv[1], sys.argv[2]
    report = {
        "uid": os.getuid(), "pid": os.getpid(), "hostname": socket.gethostname(), "cwd": os.getcwd(),
        "pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit()),
        "root": sorted(os.listdir("/")), "dev": sorted(os.listdir("/dev")),
        "shadow": os.path.lexists("/etc/shadow"), "home": os.path.lexists("/root/.bash_history"),
        "read ro": open(os.path.join(ro, "file")).read(),
        "write ro": attempt(lambda: open(os.path.join(ro, "new"), "w")),
        "write rw": attempt(lambda: open(os.path.join(rw, "new"), "w").write("x")),
        "write root": attempt(lambda: os.mkdir("/planted")),
        "write dev": attempt(lambda: open("/dev/planted", "w")),
        "dev null": attempt(lambda: open("/dev/null", "w").write("x")),
        "init root": attempt(lambda: os.listdir("/proc/1/root")),
        "root options": [line.split()[5] for line in open("/proc/self/mountinfo") if line.split()[4] == "/"],
    }
    print(json.dumps(report))
    """
)


@pytest.fixture
def folders() -> Iterator[tuple[Path, Path, Path]]:
    """A read-only folder, a writable one and a hidden sibling, under a world-traversable directory."""
    base = Path(tempfile.mkdtemp(prefix="carton-ns-test-"))
    base.chmod(0o755)
    made = []
    for name in ("ro", "rw", "hidden"):
        folder = base / name
        folder.mkdir(mode=0o755)
        (folder / "file").write_text(name)
        made.append(folder)
    yield made[0], made[1], made[2]
    shutil.rmtree(base, ignore_errors=True)


def _run(config: dict[str, Any], argv: list[str], *, prefix: tuple[str, ...] = (), python: str = sys.executable,
         ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*prefix, python, "-E", "-s", "-S", str(SHIM), json.dumps(config), "--", *argv],
                          capture_output=True, text=True, timeout=60, check=False)


@needs_unshare
@pytest.mark.parametrize("legacy_remount", [False, True], ids=["mount_setattr", "remount"])
def test_private_root_shows_only_the_allow_list(folders: tuple[Path, Path, Path], legacy_remount: bool) -> None:
    readable, writable, hidden = folders
    root = os.geteuid() == 0
    read = [*system_paths(), *import_roots(sys.executable, {}), str(readable)]
    config: dict[str, Any] = {
        "pdeathsig": True, "reaper": True, "close_fds": True,
        "namespaces": namespace_config(read=read, write=[str(writable)], cwd=str(writable),
                                       user_namespace=not root, legacy_remount=legacy_remount),
    }
    uid = fresh_uid() if root else SANDBOX_ID
    if root:
        os.chown(writable, uid, uid)
        config.update(uid=uid, gid=uid)
    done = _run(config, [sys.executable, "-E", "-S", "-c", LOOK, str(readable), str(writable)])
    assert done.returncode == 0, done.stderr
    view = json.loads(done.stdout)
    assert view["uid"] == uid
    assert (view["pid"], view["pids"], view["hostname"], view["cwd"]) == (2, [1, 2], "carton-sandbox", str(writable))
    allowed_tops = {Path(path).parts[1] for path in (*read, str(writable))} | {"proc", "dev"}
    assert set(view["root"]) <= allowed_tops
    assert hidden.name not in view["root"] and not view["shadow"] and not view["home"]
    assert view["dev"] == ["fd", "full", "null", "random", "shm", "stderr", "stdin", "stdout", "tty", "urandom",
                           "zero"]
    assert view["read ro"] == "ro"
    assert (view["write ro"], view["write rw"], view["write root"], view["write dev"], view["dev null"]) == (
        "Read-only file system", "ok", "Read-only file system", "Read-only file system", "ok")
    assert view["init root"] == "Permission denied"  # PID 1 (privileged) is out of the runner's reach
    assert view["root options"] == [view["root options"][0]] and view["root options"][0].startswith("ro,")
    assert (writable / "new").read_text() == "x"
    assert sorted(path.name for path in readable.iterdir()) == ["file"]


@needs_unshare
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv") or not Path("/usr/bin/python3").exists(),
                    reason="needs root (to become another user), setpriv and a system /usr/bin/python3")
def test_unprivileged_host_maps_the_caller_to_nobody(folders: tuple[Path, Path, Path]) -> None:
    """As an ordinary user: a user namespace maps the caller to 65534, and RLIMIT_NPROC counts only the runner."""
    readable, writable, _ = folders
    shim_dir = Path(tempfile.mkdtemp(prefix="carton-ns-shim-"))
    try:
        shim_dir.chmod(0o755)
        for name in ("_shim.py", "_namespaces.py"):
            shutil.copy(SHIM.with_name(name), shim_dir / name)
        os.chown(writable, 4321, 4321)
        config = {
            "pdeathsig": True, "reaper": True, "close_fds": True, "rlimits": {"NPROC": [12, 12]},
            "namespaces": namespace_config(read=[*system_paths(), str(shim_dir), str(readable)],
                                           write=[str(writable)], cwd=str(writable), user_namespace=True),
        }
        code = textwrap.dedent(
            """
            import os, time
            forks = 0
            try:
                while forks < 100:
                    if os.fork() == 0:
                        time.sleep(2)
                        os._exit(0)
                    forks += 1
            except OSError as exc:
                print(os.getuid(), os.getgid(), os.getpid(), forks, exc.strerror)
            try:
                os.listdir("/proc/1/root")
                print("init root readable")
            except PermissionError:
                pass
            for line in open("/proc/1/status"):
                if line.startswith(("CapEff", "CapPrm")):
                    print(line.split()[1])
            open("made-inside", "w").close()
            """
        )
        done = subprocess.run(
            ["setpriv", "--reuid", "4321", "--regid", "4321", "--clear-groups", "/usr/bin/python3", "-E", "-s",
             "-S", str(shim_dir / "_shim.py"), json.dumps(config), "--", "/usr/bin/python3", "-c", code],
            capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, done.stderr
        first, *capabilities = done.stdout.splitlines()
        uid, gid, pid, forks, why = first.split(maxsplit=4)
        assert (int(uid), int(gid), int(pid)) == (SANDBOX_ID, SANDBOX_ID, 2)
        assert int(forks) < 12 and why == "Resource temporarily unavailable"
        assert capabilities == ["0000000000000000", "0000000000000000"]  # PID 1 dropped its capabilities
        assert (writable / "made-inside").stat().st_uid == 4321  # the caller's uid outside
    finally:
        shutil.rmtree(shim_dir, ignore_errors=True)


@needs_unshare
def test_a_missing_writable_folder_is_reported_by_layer(tmp_path: Path) -> None:
    missing = tmp_path / "not-there"
    config = {"namespaces": namespace_config(read=system_paths(), write=[str(missing)], cwd="/",
                                             user_namespace=os.geteuid() != 0)}
    done = _run(config, ["/bin/true"])
    assert done.returncode == SETUP_FAILED
    assert done.stderr == f"carton sandbox: filesystem_view: {missing} does not exist\n"


def test_paths_inside_the_new_root_never_follow_links_out_of_it(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "usr" / "lib").mkdir(parents=True)
    (root / "lib").symlink_to("usr/lib")
    (root / "abs").symlink_to("/usr/lib")
    (root / "up").symlink_to("../../../../..")
    (root / "usr" / "lib" / "loop").symlink_to("/usr/lib/loop")
    assert _inside(str(root), "/lib/x/y") == f"{root}/usr/lib/x/y"
    assert _inside(str(root), "/abs/x") == f"{root}/usr/lib/x"
    assert _inside(str(root), "/up/etc/shadow") == f"{root}/etc/shadow"
    assert _inside(str(root), "/") == str(root)
    with pytest.raises(Exception, match="too many symbolic links"):
        _inside(str(root), "/lib/loop/x")
