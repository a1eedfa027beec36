"""Recordings in an S3-compatible bucket: Signature Version 4 against AWS's published examples, and the
recorder storing into a real S3 implementation (gofakes3, built from the Go module cache into
tests/support/s3server): the proxy's client recording a session, every acknowledged byte of a version 2
upload in the bucket when the recorder dies mid-session, the list read from the bucket."""
from __future__ import annotations

import asyncio
import datetime
import hashlib
import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import pytest

from containerboot.apiproxy.recclient import Upload
from labtools import s3lab
from recorder.s3 import EMPTY_SHA256, Bucket, Credentials, S3Store, sign
from recorder.server import Recorder
from tests.test_recorder import H2Client

EXAMPLE = Credentials("AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY")
WHEN = datetime.datetime(2013, 5, 24, tzinfo=datetime.timezone.utc)


@pytest.mark.parametrize("method, url, headers, body, signed, signature", [
    ("GET", "https://examplebucket.s3.amazonaws.com/test.txt", {"Range": "bytes=0-9"}, b"",
     "host;range;x-amz-content-sha256;x-amz-date", "f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41"),
    ("PUT", "https://examplebucket.s3.amazonaws.com/test%24file.text",
     {"Date": "Fri, 24 May 2013 00:00:00 GMT", "x-amz-storage-class": "REDUCED_REDUNDANCY"},
     b"Welcome to Amazon S3.", "date;host;x-amz-content-sha256;x-amz-date;x-amz-storage-class",
     "98ad721746da40c64f1a55b78f14c238d841ea1380cd77a1b5971af0ece108bd"),
    ("GET", "https://examplebucket.s3.amazonaws.com/?lifecycle", {}, b"", "host;x-amz-content-sha256;x-amz-date",
     "fea454ca298b7da1c68078a5d1bdbfbbe0d65c699e0f91ac7a200a0136783543"),
    ("GET", "https://examplebucket.s3.amazonaws.com/?max-keys=2&prefix=J", {}, b"",
     "host;x-amz-content-sha256;x-amz-date", "34b48302e7b5fa45bde8084f4b7868a86f0a534bc59db6670ed5711ef69dc6f7"),
])
def test_signature_v4_matches_awss_published_examples(method, url, headers, body, signed, signature):
    h = sign(method, url, headers, hashlib.sha256(body).hexdigest() if body else EMPTY_SHA256, EXAMPLE, WHEN)
    assert h["authorization"] == ("AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/"
                                  f"aws4_request, SignedHeaders={signed}, Signature={signature}")


def s3_binary() -> pathlib.Path:
    try:
        return s3lab.ensure_binary()
    except s3lab.S3BuildError as e:
        pytest.skip(str(e))


@pytest.fixture
def bucket():
    binary = s3_binary()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([str(binary), f"127.0.0.1:{port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                time.sleep(0.05)   # poll: until the S3 server accepts connections
        yield Bucket(f"http://127.0.0.1:{port}", "recordings", Credentials("key-id", "secret"))
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
async def rec(bucket):
    r = Recorder(S3Store(bucket), ui=True)
    server = await asyncio.start_server(r.handle, "127.0.0.1", 0)
    r.addr = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    r.bucket = bucket
    yield r
    server.close()


async def test_the_proxys_client_records_into_the_bucket_and_the_list_reads_it(rec):
    up = await Upload.connect([rec.addr])
    head = b'{"version":2,"width":80,"height":24,"timestamp":7,"srcNodeUser":"alice","kubernetes":{"PodName":"web"}}\n'
    await up.write(head)
    await up.write(b'[0.1,"o","hello"]\n')
    await up.finish()
    (key, size), = await asyncio.to_thread(rec.bucket.keys)
    assert await asyncio.to_thread(rec.bucket.get, key) == head + b'[0.1,"o","hello"]\n'
    (e,) = await asyncio.to_thread(rec.store.list)
    assert (e.name, e.user, e.kubernetes, e.size) == (key, "alice", {"PodName": "web"}, size)


async def test_every_acknowledged_byte_is_in_the_bucket_when_the_recorder_is_killed_mid_session(bucket, tmp_path):
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    log = open(tmp_path / "recorder.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "recorder"], stdout=log, stderr=log, env={
        **os.environ, "TSRECORDER_DST": "s3://" + bucket.base.rsplit("/", 1)[0], "TSRECORDER_BUCKET": bucket.bucket,
        "TSRECORDER_LISTEN": f"127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "key-id", "AWS_SECRET_ACCESS_KEY": "secret"})
    try:
        for _ in range(200):
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                break
            except OSError:
                await asyncio.sleep(0.05)   # poll: until the recorder accepts connections
        c = H2Client(reader, writer)
        c.conn.send_headers(1, [(":method", "POST"), (":path", "/v2/record"), (":scheme", "http"),
                                (":authority", "r")])
        sent = b""
        for i in range(3):
            chunk = b'{"version":2}\n' if i == 0 else f'[{i},"o","line {i}"]\n'.encode()
            c.conn.send_data(1, chunk)
            sent += chunk
            await c.send()
            await c.pump(lambda sent=sent: {"ack": len(sent)} in c.frames)
            (key, _), = await asyncio.to_thread(bucket.keys)
            assert await asyncio.to_thread(bucket.get, key) == sent     # acknowledged: in the bucket
        c.conn.send_data(1, b'[9,"o","never acknowledged"]\n')
        await c.send()
        proc.kill()                                                     # SIGKILL: no goodbye
        proc.wait()
        got = await asyncio.to_thread(bucket.get, key)
        assert got is not None and got.startswith(sent)
    finally:
        proc.kill()
        proc.wait()
        log.close()


async def test_api_request_events_are_objects_in_the_bucket_and_listed(rec):
    from containerboot.apiproxy.eventclient import send_event
    await send_event(rec.addr, b'{"type":"kubernetes-api-request","timestamp":7,"source":{"nodeUser":"alice"}}\n')
    keys = await asyncio.to_thread(rec.bucket.keys)
    [(key, _)] = keys
    assert key.startswith("events/") and key.endswith(".json")
    stored = json.loads(await asyncio.to_thread(rec.bucket.get, key))
    assert stored == {"type": "kubernetes-api-request", "timestamp": 7, "source": {"nodeUser": "alice"}, "id": key}
    assert await asyncio.to_thread(rec.store.list) == []        # not a recording
    [(name, data)] = await asyncio.to_thread(rec.store.list_events)
    assert f"events/{name}" == key and json.loads(data) == stored
