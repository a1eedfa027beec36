"""tailscaled, `tailscale up` and `tailscale set` command lines, with upstream's flags and order."""
from __future__ import annotations

from containerboot.settings import load
from containerboot.tailscaled import flag_name, tailscale_set_argv, tailscale_up_argv, tailscaled_argv
from tests.support.waits import until_async


def s(**env):
    return load({k: v for k, v in env.items()})


def test_tailscaled_defaults():
    assert tailscaled_argv(s()) == ["tailscaled", "--socket=/tmp/tailscaled.sock", "--state=mem:",
                                    "--statedir=/tmp", "--tun=userspace-networking"]


def test_tailscaled_state_dir_kernel_mode_proxies_and_extra_args():
    argv = tailscaled_argv(s(TS_STATE_DIR="/var/lib/ts", TS_USERSPACE="false", TS_SOCKS5_SERVER="localhost:1080",
                             TS_OUTBOUND_HTTP_PROXY_LISTEN="localhost:8080",
                             TS_TAILSCALED_EXTRA_ARGS="--port=41641  --verbose=1"))
    assert argv == ["tailscaled", "--socket=/tmp/tailscaled.sock", "--statedir=/var/lib/ts",
                    "--socks5-server=localhost:1080", "--outbound-http-proxy-listen=localhost:8080",
                    "--port=41641", "--verbose=1"]


def test_tailscaled_kube_state_and_debug_addr():
    argv = tailscaled_argv(s(KUBERNETES_SERVICE_HOST="10.0.0.1", TS_DEBUG_ADDR_PORT="127.0.0.1:9001"))
    assert argv[2:4] == ["--state=kube:tailscale", "--statedir=/tmp"]
    assert argv[-1] == "--debug=127.0.0.1:9001"
    # not added twice when the extra args already name it
    argv = tailscaled_argv(s(TS_DEBUG_ADDR_PORT="127.0.0.1:9001",
                             TS_TAILSCALED_EXTRA_ARGS="--debug=127.0.0.1:9001"))
    assert argv.count("--debug=127.0.0.1:9001") == 1


def test_up_argv_order():
    argv = tailscale_up_argv(s(TS_AUTHKEY="tskey-key", TS_ROUTES="1.2.3.0/24,10.20.30.0/24"))
    assert argv == ["tailscale", "--socket=/tmp/tailscaled.sock", "up", "--accept-dns=false",
                    "--authkey=tskey-key", "--advertise-routes=1.2.3.0/24,10.20.30.0/24"]
    assert tailscale_up_argv(s(TS_AUTHKEY="tskey-key", TS_ROUTES=""))[-1] == "--advertise-routes="
    assert tailscale_up_argv(s(TS_HOSTNAME="my-server"))[3:] == ["--accept-dns=false", "--hostname=my-server"]
    assert tailscale_up_argv(s(TS_EXTRA_ARGS="--accept-dns"))[3:] == ["--accept-dns=true"]
    assert tailscale_up_argv(s(TS_EXTRA_ARGS="--login-server=http://h:8080 --advertise-exit-node"))[4:] == [
        "--login-server=http://h:8080", "--advertise-exit-node"]


def test_up_argv_oauth():
    argv = tailscale_up_argv(s(TS_CLIENT_ID="cid", TS_CLIENT_SECRET="sec"))
    assert argv[4:] == ["--client-id=cid", "--client-secret=sec"]


def test_set_argv_reapplies_extra_args_set_accepts():
    """Upstream drops TS_EXTRA_ARGS with TS_AUTH_ONCE; here `set` gets every flag it accepts."""
    argv, skipped = tailscale_set_argv(s(TS_AUTH_ONCE="true", TS_HOSTNAME="h", TS_ROUTES="10.0.0.0/8",
                                         TS_EXTRA_ARGS="--login-server=http://h:8080 --advertise-exit-node "
                                                       "--timeout 30s --snat-subnet-routes=false"))
    assert argv == ["tailscale", "--socket=/tmp/tailscaled.sock", "set", "--accept-dns=false",
                    "--advertise-routes=10.0.0.0/8", "--hostname=h", "--advertise-exit-node",
                    "--snat-subnet-routes=false"]
    assert skipped == ["--login-server=http://h:8080", "--timeout", "30s"]


def test_flag_name():
    assert flag_name("--foo=bar") == "foo"
    assert flag_name("-foo") == "foo"
    assert flag_name("value") is None


def test_exit_node_plus_subnet_routes_warns_about_the_conflict():
    from containerboot.tailscaled import routing_warnings

    (w,) = routing_warnings(s(TS_ROUTES="10.1.0.0/16", TS_EXTRA_ARGS="--advertise-exit-node"))
    assert "10.1.0.0/16" in w and "two proxies" in w
    (w,) = routing_warnings(s(TS_ROUTES="0.0.0.0/0,::/0,10.1.0.0/16"))
    assert "default route subsumes" in w
    assert routing_warnings(s(TS_ROUTES="10.1.0.0/16")) == []
    assert routing_warnings(s(TS_EXTRA_ARGS="--advertise-exit-node")) == []
    assert routing_warnings(s(TS_ROUTES="0.0.0.0/0,::/0")) == []


def test_child_env_brackets_an_ipv6_api_server_host():
    from containerboot.tailscaled import child_env

    env = {"KUBERNETES_SERVICE_HOST": "fd99::1", "KUBERNETES_SERVICE_PORT_HTTPS": "6443"}
    assert child_env(s(), env)["KUBERNETES_SERVICE_HOST"] == "[fd99::1]"
    assert child_env(s(), {"KUBERNETES_SERVICE_HOST": "10.0.0.1"})["KUBERNETES_SERVICE_HOST"] == "10.0.0.1"


async def test_a_tailscaled_started_before_the_event_loop_is_supervised_like_any_other(tmp_path):
    """__main__ starts tailscaled before the agent's imports; the agent adopts it: exit noticed without
    polling, signals delivered, status reported."""
    import asyncio
    import signal
    import subprocess

    from containerboot.tailscaled import Tailscaled

    popen = subprocess.Popen(["sleep", "30"], process_group=0)
    t = Tailscaled.adopt(popen, str(tmp_path / "ts.sock"))
    assert t.alive() and t.pid == popen.pid
    waiter = asyncio.create_task(t.proc.wait())
    # parked on the process's exit (a pidfd, or a thread that waits): only the exit can end it now
    await until_async(lambda: t.proc._exited is not None, what="the waiter parked on the exit")
    assert not waiter.done()
    assert await t.stop(5) == -signal.SIGTERM
    assert await asyncio.wait_for(waiter, 5) == -signal.SIGTERM and not t.alive()
