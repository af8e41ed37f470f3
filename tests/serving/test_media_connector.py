"""MediaConnector against a real HTTP server on 127.0.0.1 and data: URLs: the bytes come back; too large (with or
without Content-Length), too slow, a 404, a bad scheme or host, bad base64, a non-image media type are refused
with a message naming the problem, in bounded time."""
import base64
import http.server
import io
import threading
import time

import pytest
from PIL import Image

from common.serving.media_connector import MediaConnector, MediaError


def png(size=(8, 6)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, (10, 200, 30)).save(out, "PNG")
    return out.getvalue()


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        try:
            self.answer()
        except (BrokenPipeError, ConnectionResetError):  # the connector hung up, as it should
            pass

    def answer(self):
        body = png()
        if self.path == "/image.png":
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        elif self.path == "/big-declared":
            self.send_response(200)
            self.send_header("Content-Length", str(10 << 20))
            self.end_headers()
        elif self.path == "/big-chunked":  # no length: the connector counts what arrives
            self.send_response(200)
            self.end_headers()
            for _ in range(64):
                self.wfile.write(b"\0" * (1 << 16))
        elif self.path == "/slow":
            self.send_response(200)
            self.end_headers()
            for _ in range(40):
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.1)
        else:
            self.send_error(404)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def base_url():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_http_and_data_urls_give_the_image_bytes(base_url):
    connector = MediaConnector(max_bytes=1 << 20, timeout_s=5)
    assert connector.fetch(f"{base_url}/image.png") == png()
    data = png((3, 3))
    assert connector.fetch("data:image/png;base64," + base64.b64encode(data).decode()) == data
    assert connector.fetch("data:image/png," + "".join(f"%{b:02x}" for b in data)) == data
    with Image.open(io.BytesIO(connector.fetch(f"{base_url}/image.png"))) as image:
        assert image.size == (8, 6)


@pytest.mark.parametrize("path, needle", [("/big-declared", "bytes; at most"), ("/big-chunked", "larger than"),
                                          ("/missing", "HTTP 404")])
def test_http_refusals(base_url, path, needle):
    with pytest.raises(MediaError, match=needle):
        MediaConnector(max_bytes=1 << 20, timeout_s=5).fetch(base_url + path)


def test_a_slow_server_is_cut_off_at_the_deadline(base_url):
    t0 = time.monotonic()
    with pytest.raises(MediaError, match="longer than 0.5 s"):
        MediaConnector(timeout_s=0.5).fetch(f"{base_url}/slow")
    assert time.monotonic() - t0 < 2.0  # the server would take 4 s


@pytest.mark.parametrize("url, needle", [
    ("file:///etc/passwd", "data: or http"),
    ("ftp://example.com/a.png", "data: or http"),
    ("data:image/png;base64,@@@", "not valid base64"),
    ("data:text/plain;base64,aGk=", "not an image"),
    ("data:image/png;base64", "data:<media type>"),
    ("", "non-empty"),
])
def test_url_refusals(url, needle):
    with pytest.raises(MediaError, match=needle):
        MediaConnector().fetch(url)


def test_size_and_domain_limits(base_url):
    big = "data:image/png;base64," + base64.b64encode(b"\0" * 2000).decode()
    with pytest.raises(MediaError, match="larger than 1000 bytes"):
        MediaConnector(max_bytes=1000).fetch(big)
    with pytest.raises(MediaError, match="may name example.org"):
        MediaConnector(allowed_domains=("example.org",)).fetch(f"{base_url}/image.png")
    assert MediaConnector(allowed_domains=("127.0.0.1",)).fetch(f"{base_url}/image.png") == png()
    with pytest.raises(ValueError, match="max_bytes"):
        MediaConnector(max_bytes=0)
