"""Remote images, fetched only from the domains a server names (--allowed-media-domains, vLLM's).

Off by default: with no domain named, an http(s) image URL is refused by name and nothing is
fetched. With domains named, a URL whose host is one of them (or a subdomain of one) is fetched
on the work thread that prepares the request, never on the event loop, within a deadline for the
whole transfer (a server that trickles bytes holds the thread no longer) and a byte limit (read
no further than --max-media-bytes). A redirect is followed only to an allowed domain. Every
failure is an INVALID_ARGUMENT naming the URL and what went wrong.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Sequence

from jaxserve.config import short
from jaxserve.serving.gateway import invalid

FETCH_TIMEOUT_S = 10.0  # The whole transfer: connecting, the headers and every byte.
_CHUNK = 64 * 1024


def allowed(url: str, domains: Sequence[str]) -> bool:
  """Whether `url`'s host is one of `domains` or a subdomain of one."""
  host = (urllib.parse.urlsplit(url).hostname or "").lower().rstrip(".")
  return any(host == d or host.endswith("." + d) for d in domains)


def fetch(url: str, field: str, domains: Sequence[str], max_bytes: int,
          timeout_s: float = FETCH_TIMEOUT_S) -> bytes:
  """The file at `url` (http or https, on an allowed domain), at most `max_bytes` of it."""
  if not domains:
    raise invalid(f"{field}: remote image URLs are refused ({short(url, 80)}): this server "
                  "fetches nothing over the network unless --allowed-media-domains names the "
                  "domain; send the image inline as a data URL (data:image/png;base64,...)")
  if not allowed(url, domains):
    host = urllib.parse.urlsplit(url).hostname
    raise invalid(f"{field}: remote image URLs are refused ({short(url, 80)}): this server "
                  f"fetches only from the domains --allowed-media-domains names, and {host!r} is "
                  "not one; send the image inline as a data URL (data:image/png;base64,...)")
  opener = urllib.request.build_opener(_Redirects(domains, field))
  try:
    with opener.open(urllib.request.Request(url, headers={"User-Agent": "jaxserve"}),
                     timeout=timeout_s) as response:
      return _read(response, field, url, max_bytes, timeout_s)
  except urllib.error.HTTPError as e:
    raise invalid(f"{field}: the image at {short(url, 80)} could not be fetched: HTTP "
                  f"{e.code}") from e
  except (urllib.error.URLError, OSError, ValueError) as e:  # DNS, refused, reset, timed out.
    raise invalid(f"{field}: the image at {short(url, 80)} could not be fetched: "
                  f"{getattr(e, 'reason', e)}") from e


def _read(response, field: str, url: str, max_bytes: int, timeout_s: float) -> bytes:
  """The body, no more than `max_bytes` and within `timeout_s` in all."""
  deadline, chunks, size = time.monotonic() + timeout_s, [], 0
  while chunk := response.read(_CHUNK):
    size += len(chunk)
    if size > max_bytes:
      raise invalid(f"{field}: the image at {short(url, 80)} is more than this server's limit "
                    f"of {max_bytes:,} bytes (--max-media-bytes)")
    if time.monotonic() > deadline:
      raise invalid(f"{field}: the image at {short(url, 80)} took more than "
                    f"{timeout_s:g} s to fetch")
    chunks.append(chunk)
  return b"".join(chunks)


class _Redirects(urllib.request.HTTPRedirectHandler):
  """Follows a redirect only to an allowed domain (else a host the operator never named could
  be reached through one that is)."""

  def __init__(self, domains: Sequence[str], field: str):
    self._domains = domains
    self._field = field

  def redirect_request(self, req, fp, code, msg, headers, newurl):
    if not allowed(newurl, self._domains):
      raise invalid(f"{self._field}: the image URL redirects to {short(newurl, 80)}, whose "
                    "domain --allowed-media-domains does not name")
    return super().redirect_request(req, fp, code, msg, headers, newurl)
