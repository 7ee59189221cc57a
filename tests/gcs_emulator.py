"""A local GCS emulator on loopback (gcp-storage-emulator), for the object-store tests.

Started as a process of its own on 127.0.0.1, in memory, and stopped by its PID; its
media downloads carry the object's generation, as GCS's do (`_SERVER`).
`env()` is what points a child process at it: tensorstore's gcs driver (Orbax's
arrays) by TENSORSTORE_GCS_HTTP_URL, and epath's gs:// paths (Orbax's and
spmd's folder operations) through fsspec's gcsfs by STORAGE_EMULATOR_HOST.
"""

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request

BUCKET = "spmd"
_START_S = 60.0  # the longest wait for the emulator to answer


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The emulator as GCS answers a media download: with the object's generation in the
# x-goog-generation header (and its metageneration), which tensorstore reads as the
# version it read. Without it a read's generation is 0, and tensorstore refuses a write
# conditioned on it ("Malformed StorageGeneration"): OCDBT's writer, which reads its
# manifest again when its cached copy is stale (under load), then failed its save.
# (The emulator reads an object's bytes and its record in two steps: a write between
# them would pair the bytes with the next generation. The tests write each object from
# one process, one write after another.)
_SERVER = """
import sys
from gcp_storage_emulator.exceptions import NotFound
from gcp_storage_emulator.handlers import objects

_download = objects.download

def download(request, response, storage, *args, **kwargs):
    _download(request, response, storage, *args, **kwargs)
    try:
        obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
    except NotFound:  # the download answered 404 already
        return
    response["x-goog-generation"] = str(obj["generation"])
    response["x-goog-metageneration"] = str(obj["metageneration"])

objects.download = download  # before the server module builds its handler table
from gcp_storage_emulator.__main__ import main
main(sys.argv[1:])
"""


class GcsEmulator:
    """One emulator process with one bucket, `BUCKET`."""

    def __init__(self) -> None:
        if importlib.util.find_spec("gcp_storage_emulator") is None:
            raise RuntimeError(
                "the object-store tests need gcp-storage-emulator and gcsfs: "
                'pip install gcp-storage-emulator gcsfs (both in spmd\'s "test" extra)'
            )
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen(
            [sys.executable, "-c", _SERVER, "start", "--host", "127.0.0.1"]
            + ["--port", str(self.port), "--in-memory", "--default-bucket", BUCKET, "-q"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + _START_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"gcp-storage-emulator exited ({self.process.returncode})")
            try:
                self._get(f"/storage/v1/b/{BUCKET}")
                return
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"gcp-storage-emulator did not answer on {self.url} in {_START_S} s")

    def env(self) -> dict[str, str]:
        """What a child process needs to reach the emulator for gs:// paths."""
        return {
            "TENSORSTORE_GCS_HTTP_URL": self.url,
            "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator",  # tensorstore: no credential lookup
            "STORAGE_EMULATOR_HOST": self.url,
            "FSSPEC_GCS_TOKEN": "anon",
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",  # no gRPC bucket-type probe
            "EPATH_USE_TF": "false",  # epath through fsspec: TF's gfile cannot be redirected
        }

    def objects(self, prefix: str) -> list[str]:
        """The names of the bucket's objects under `prefix`, sorted."""
        query = urllib.parse.urlencode({"prefix": prefix})
        names, token = [], None
        while True:
            page = json.loads(
                self._get(
                    f"/storage/v1/b/{BUCKET}/o?{query}" + (f"&pageToken={token}" if token else "")
                )
            )
            names += [item["name"] for item in page.get("items", [])]
            token = page.get("nextPageToken")
            if not token:
                return sorted(names)

    def read(self, name: str) -> bytes:
        quoted = urllib.parse.quote(name, safe="")
        return self._get(f"/download/storage/v1/b/{BUCKET}/o/{quoted}?alt=media")

    def write(self, name: str, data: bytes) -> None:
        query = urllib.parse.urlencode({"uploadType": "media", "name": name})
        request = urllib.request.Request(
            f"{self.url}/upload/storage/v1/b/{BUCKET}/o?{query}", data=data, method="POST"
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            response.read()

    def _get(self, path: str) -> bytes:
        with urllib.request.urlopen(f"{self.url}{path}", timeout=30) as response:
            return response.read()

    def stop(self) -> None:
        """Stops the emulator process (by its PID), waiting for it to end."""
        if self.process.poll() is None:
            os.kill(self.process.pid, 15)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(self.process.pid, 9)
                self.process.wait(timeout=10)
