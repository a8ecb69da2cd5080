"""The search tool of a Search-R1 run: a query to Search-R1's retrieval server, its passages as
the model reads them. Start the server as Search-R1's README says (an e5 index of Wikipedia,
`search_r1/search/retrieval_server.py`, port 8000), then

    rollover train examples/search_r1_nq.yaml

`SEARCH_URL` (default http://127.0.0.1:8000/retrieve) and `SEARCH_TOPK` (default 3) point it
elsewhere. A server that does not answer raises: the episode fails and is counted, rather than
the model learning from an empty result.
"""

import json
import os
import urllib.request


def search(query: str) -> str:
    """The top passages for `query`, one per line as "Doc i(Title: ...) text"."""
    url = os.environ.get("SEARCH_URL", "http://127.0.0.1:8000/retrieve")
    body = json.dumps({"queries": [query.strip()], "topk": int(os.environ.get("SEARCH_TOPK", "3")),
                       "return_scores": True}).encode()
    request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        hits = json.load(response)["result"][0]
    lines = []
    for i, hit in enumerate(hits, 1):
        title, _, text = hit["document"]["contents"].partition("\n")
        lines.append(f"Doc {i}(Title: {title.strip(chr(34))}) {text}")
    return "\n".join(lines)
