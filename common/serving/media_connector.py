"""The bytes of an image a request names by URL (vLLM's MediaConnector): `data:` URLs (base64 or percent-encoded)
and http(s) URLs, fetched with a bound on bytes and on time, and on the pixels the image's header declares.
Decoding the bytes is the image processor's job.

Every refusal is a MediaError (a ValueError) whose message names the problem; the server answers it with a 400.
"""
from __future__ import annotations

import base64
import binascii
import time
import urllib.error
import urllib.parse
import io
import urllib.request
from dataclasses import dataclass

from PIL import Image

CHUNK = 1 << 16


class MediaError(ValueError):
    pass


@dataclass(frozen=True)
class MediaConnector:
    """max_bytes: the largest image accepted (encoded); timeout_s: the longest an http(s) fetch may take in all;
    allowed_domains: hosts http(s) URLs may name (None: any; a server facing untrusted clients should list them,
    or it fetches whatever its clients point it at); max_pixels: the largest width x height an image's header may
    declare (read before any pixel is decoded; an image whose header does not read is left to the processor)."""
    max_bytes: int = 20 << 20
    timeout_s: float = 10.0
    allowed_domains: tuple[str, ...] | None = None
    max_pixels: int = 50_000_000

    def __post_init__(self):
        for name in ("max_bytes", "max_pixels"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) > 0):
                raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s!r}")

    def fetch(self, url: str) -> bytes:
        """The encoded image `url` names (blocking: run it in a thread from async code)."""
        if not isinstance(url, str) or not url:
            raise MediaError("an image URL must be a non-empty string")
        scheme = url.split(":", 1)[0].lower()
        if scheme == "data":
            data = self._data(url)
        elif scheme in ("http", "https"):
            data = self._http(url)
        else:
            raise MediaError(f"image URLs are data: or http(s):, not "
                             f"{scheme + ':' if ':' in url else repr(url[:40])}")
        self._check_pixels(data)
        return data

    def _check_pixels(self, data: bytes) -> None:
        try:
            with Image.open(io.BytesIO(data)) as image:  # the header only
                width, height = image.size
        except (OSError, ValueError, Image.DecompressionBombError):
            return  # not an image (or a broken one): the processor says which
        if width * height > self.max_pixels:
            raise MediaError(f"the image is {width}x{height} = {width * height} pixels, more than the "
                             f"{self.max_pixels} allowed")

    def _data(self, url: str) -> bytes:
        head, sep, payload = url[5:].partition(",")
        if not sep:
            raise MediaError("a data: URL is data:<media type>[;base64],<data>")
        media_type, *params = head.split(";")
        if media_type and not media_type.lower().startswith("image/"):
            raise MediaError(f"a data: URL of media type {media_type!r}, not an image")
        if len(payload) > self.max_bytes * 4 // 3 + 4:
            raise MediaError(f"the image is larger than {self.max_bytes} bytes")
        if "base64" in (p.lower() for p in params):
            try:
                data = base64.b64decode(payload, validate=True)
            except (binascii.Error, ValueError):
                raise MediaError("the data: URL's base64 payload is not valid base64") from None
        else:
            data = urllib.parse.unquote_to_bytes(payload)
        if len(data) > self.max_bytes:
            raise MediaError(f"the image is larger than {self.max_bytes} bytes")
        return data

    def _http(self, url: str) -> bytes:
        host = urllib.parse.urlsplit(url).hostname
        if self.allowed_domains is not None and host not in self.allowed_domains:
            raise MediaError(f"image URLs may name {', '.join(self.allowed_domains) or 'no host'}; not {host!r}")
        deadline = time.monotonic() + self.timeout_s
        try:
            with urllib.request.urlopen(url, timeout=self.timeout_s) as response:
                size = response.headers.get("Content-Length")
                if size is not None and size.isdigit() and int(size) > self.max_bytes:
                    raise MediaError(f"the image at {url} is {size} bytes; at most {self.max_bytes} are accepted")
                chunks, total = [], 0
                while chunk := response.read1(CHUNK):  # what has arrived: the deadline is checked between
                    total += len(chunk)
                    if total > self.max_bytes:
                        raise MediaError(f"the image at {url} is larger than {self.max_bytes} bytes")
                    if time.monotonic() > deadline:
                        raise MediaError(f"fetching {url} took longer than {self.timeout_s:g} s")
                    chunks.append(chunk)
                return b"".join(chunks)
        except MediaError:
            raise
        except urllib.error.HTTPError as e:
            raise MediaError(f"fetching {url} answered HTTP {e.code}") from None
        except TimeoutError:
            raise MediaError(f"fetching {url} took longer than {self.timeout_s:g} s") from None
        except (urllib.error.URLError, OSError, ValueError) as e:
            reason = getattr(e, "reason", e)
            if isinstance(reason, TimeoutError):
                raise MediaError(f"fetching {url} took longer than {self.timeout_s:g} s") from None
            raise MediaError(f"fetching {url} failed: {reason}") from None
