"""The auth key reissue wait watches the config directory: a kubelet-style `..data` swap carrying the new key
is noticed through the watch, not only by the 5 s poll (which the test turns off)."""
from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

import containerboot.reissue as reissue_mod
from containerboot.kube.client import KubeClient
from containerboot.kube.state import SecretState
from containerboot.settings import load

SECRET = "proxy-0"


def kubelet_mount(directory: Path, generation: int, key: str) -> None:
    """Write the config the way kubelet updates a mounted Secret: a new timestamped directory, a `..data_tmp`
    link to it renamed over `..data`, and the file itself a link through `..data`."""
    gen = directory / f"..2026_11_24_05_00_0{generation}.000000001"
    gen.mkdir()
    (gen / "cap-142.hujson").write_text(f'{{"Version": "alpha0", "AuthKey": "{key}"}}')
    tmp = directory / "..data_tmp"
    os.symlink(gen.name, tmp)
    os.replace(tmp, directory / "..data")
    link = directory / "cap-142.hujson"
    if not link.is_symlink():
        os.symlink("..data/cap-142.hujson", link)


class FakeLocalAPI:
    def __init__(self) -> None:
        self.disconnected = 0

    async def disconnect_control(self) -> None:
        self.disconnected += 1


async def test_reissue_reacts_to_the_data_swap_through_the_watch(kube_api, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(reissue_mod, "REISSUE_POLL_INTERVAL", 3600.0)   # no poll: only the watch can see it
    confdir = tmp_path / "tsconfig"
    confdir.mkdir()
    kubelet_mount(confdir, 1, "tskey-auth-OLD")
    env = {**kube_api.env(), "TS_KUBE_SECRET": SECRET, "TS_TEST_ONLY_ROOT": kube_api.root,
           "TS_EXPERIMENTAL_VERSIONED_CONFIG_DIR": str(confdir)}
    kube_api.put_secret(SECRET, {"device_id": b"nOld"})
    api = FakeLocalAPI()
    caplog.set_level(logging.INFO, logger="containerboot")
    async with KubeClient.from_environment(kube_api.env(), root=kube_api.root) as kc:
        task = asyncio.create_task(reissue_mod.reissue(
            "Auth key missing or invalid (NeedsLogin state)", secret=SecretState(kc, SECRET), api=api,
            config_path=load(env).tailscaled_config_path, old_key="tskey-auth-OLD"))
        async with asyncio.timeout(20):
            while (kube_api.secret_data(SECRET) or {}).get("reissue_authkey") != b"tskey-auth-OLD":
                assert not task.done(), task
                await asyncio.sleep(0.02)   # poll: until the request for a new key is in the Secret
        assert api.disconnected == 1
        lines = [r.getMessage() for r in caplog.records]
        watching = [m for m in lines if m.endswith("auth key reissue: watching for config changes via fsnotify")]
        assert watching and str(confdir) in watching[0], lines
        kubelet_mount(confdir, 2, "tskey-auth-NEW")     # the operator's new key
        async with asyncio.timeout(20):
            await task
    msgs = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("New auth key received from operator after") for m in msgs), msgs
    assert "reissue_authkey" not in kube_api.secret_data(SECRET)
    assert "Successfully received new auth key, restarting to apply configuration" in msgs


async def test_without_a_usable_watch_the_poll_still_finds_the_key(kube_api, tmp_path, monkeypatch, caplog):
    import tscommon.watch as watch_mod

    def broken_start(self):
        raise OSError(24, "inotify instance limit reached")

    monkeypatch.setattr(watch_mod.DirWatch, "start", broken_start)
    monkeypatch.setattr(reissue_mod, "REISSUE_POLL_INTERVAL", 0.05)
    confdir = tmp_path / "tsconfig"
    confdir.mkdir()
    kubelet_mount(confdir, 1, "tskey-auth-OLD")
    env = {**kube_api.env(), "TS_KUBE_SECRET": SECRET, "TS_TEST_ONLY_ROOT": kube_api.root,
           "TS_EXPERIMENTAL_VERSIONED_CONFIG_DIR": str(confdir)}
    kube_api.put_secret(SECRET, {})
    api = FakeLocalAPI()
    caplog.set_level(logging.INFO, logger="containerboot")
    async with KubeClient.from_environment(kube_api.env(), root=kube_api.root) as kc:
        task = asyncio.create_task(reissue_mod.reissue("reason", secret=SecretState(kc, SECRET), api=api,
                                                       config_path=load(env).tailscaled_config_path,
                                                       old_key="tskey-auth-OLD"))
        async with asyncio.timeout(20):   # the wait has polled at least once before the key arrives
            while not any(r.getMessage().startswith("Waiting for new auth key from operator")
                          for r in caplog.records):
                assert not task.done(), task
                await asyncio.sleep(0.02)   # poll: until the wait has said it waits
        kubelet_mount(confdir, 2, "tskey-auth-NEW")
        async with asyncio.timeout(20):
            await task
    msgs = [r.getMessage() for r in caplog.records]
    assert any("cannot watch" in m and "using polling" in m for m in msgs), msgs
    assert "Successfully received new auth key, restarting to apply configuration" in msgs
