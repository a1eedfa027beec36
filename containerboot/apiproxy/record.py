"""A kubectl exec/attach session being recorded (adapter): the stream readers, the cast and the upload.

The proxy feeds it a copy of each chunk it pipes (`client`, `server`) and then awaits `send()`, so that a
slow recorder slows the session rather than filling memory (upstream writes to the recorder in line too).
When the recording breaks (the recorder fails, or the bytes are not the announced protocol) it either ends
the session (`enforceRecorder`: RecordingFailed) or, failing open, logs it with upstream's words once and
lets the session go on unrecorded.
"""
from __future__ import annotations

import logging
import time
from typing import Any

from .cast import Cast, SessionInfo, session_info
from .recclient import RecorderError, Upload, UploadV2
from .recording import SPDY, Session
from .streams import SpdySession, StreamError, WebSocketSession

log = logging.getLogger("containerboot")


class RecordingFailed(Exception):
    """Recording broke and it is enforced: the session must end."""


class Recording:
    def __init__(self, upload: Upload | UploadV2, info: SessionInfo, protocol: str, *, fail_open: bool) -> None:
        self.upload, self.info, self.fail_open = upload, info, fail_open
        self._streams: Any = SpdySession() if protocol == SPDY else WebSocketSession()
        self._cast = Cast(info, start=time.monotonic(), timestamp=int(time.time()))
        self._pending = bytearray(self._cast.begin())
        self.stopped = False        # failed open: nothing more is recorded

    def client(self, data: bytes) -> None:
        self._feed(self._streams.client, data)

    def server(self, data: bytes) -> None:
        self._feed(self._streams.server, data)

    def _feed(self, parse: Any, data: bytes) -> None:
        if self.stopped:
            return
        try:
            self._pending += self._cast.events(time.monotonic(), parse(data))
        except StreamError as e:
            self._broke(f"error parsing the session's stream: {e}")

    async def send(self) -> None:
        """Upload what the last chunks made; RecordingFailed when recording broke and is enforced."""
        if self.stopped or not self._pending:
            return
        data, self._pending = bytes(self._pending), bytearray()
        try:
            await self.upload.write(data)
        except RecorderError as e:
            self._broke(f"connection to the session recorder errored: {e}")

    def _broke(self, why: str) -> None:
        self.stopped = True
        self._pending.clear()
        if self.fail_open:
            log.info("api-server-proxy: %s; failure mode is 'fail open'; continuing session without recording.",
                     why)
            self.upload.abort()
            return
        log.error("api-server-proxy: %s; failure mode set to 'fail closed'; closing connection", why)
        self.upload.abort()
        raise RecordingFailed(why)

    async def finish(self) -> None:
        """The session ended: the rest of the cast, then the recorder's confirmation."""
        if self.stopped:
            return
        self.stopped = True
        try:
            await self.upload.write(self._cast.end(time.monotonic()) + bytes(self._pending))
            await self.upload.finish()
            log.info("api-server-proxy: finished uploading the recording of the %s session to %s/%s to %s",
                     self.info.session_type, self.info.namespace, self.info.pod, self.upload.addr)
        except RecorderError as e:
            log.warning("api-server-proxy: the recording of the %s session to %s/%s did not finish: %s",
                        self.info.session_type, self.info.namespace, self.info.pod, e)
            self.upload.abort()

    def abort(self) -> None:
        self.stopped = True
        self.upload.abort()


async def start_recording(addrs: tuple[str, ...], session: Session, caller: Any, target: bytes, *,
                          fail_open: bool) -> Recording:
    """Connect to the first recorder that takes the session; RecorderUnavailable (from the server module's
    point of view: RecorderError) when none does."""
    upload = await Upload.connect(addrs)
    info = session_info(caller.who, session.type, session.namespace, session.pod, target)
    log.info("api-server-proxy: %s session to container %r in Pod %r namespace %r will be recorded, the recording "
             "will be sent to a recorder at %s", session.type, info.container, session.pod, session.namespace,
             upload.addr)
    return Recording(upload, info, session.protocol, fail_open=fail_open)
