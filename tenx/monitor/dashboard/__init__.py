"""The dashboard: a run's curves, band, statistics and events in a browser, live or as one offline file.

- data.py    a run directory as a JSON view (read incrementally; a run being written is fine)
- server.py  `tenx dashboard`: a read-only HTTP server on loopback, serving the page and the views
- page.py    the HTML page (page.html and dashboard.js beside it) and `tenx report`'s self-contained file
- cli.py     the two subcommands' flags and functions

Charts are drawn by plotly.js, whose minified file ships inside the `plotly` pip package: the server
serves it from a local URL and the report inlines it, so neither needs a network.
"""
