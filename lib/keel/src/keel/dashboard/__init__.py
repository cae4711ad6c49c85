"""keel.dashboard: one page showing an experiment from its prefix alone (`keel dashboard EXP.py`).

`state` builds the document the page draws (graph, runs, comparison, fact sheets, predictions);
`server` serves it live on 127.0.0.1, `export` writes the same page as static files. The page's
script and style ship in `static/` inside this package: no CDN, no wandb account, works offline.
"""

from keel.dashboard.server import export, make_server, serve
from keel.dashboard.state import build_state

__all__ = ["build_state", "export", "make_server", "serve"]
