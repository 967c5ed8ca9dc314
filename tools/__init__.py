"""The checkout's own tools, run from the repository root as `python -m tools.NAME`:

- translation   the book's prose as a gettext catalogue per language, and the
                notebook each catalogue builds
- build_site    the book's website (`make site`)
- export_html   an executed notebook as one offline HTML page (`make html`)
- repository    the repository's public address, and the links derived from it
- pages         whether GitHub Pages publishes from Actions (the site workflow)
- results_table the committed `multi30k` run's Results, as the book shows them
- diagrams      the book's architecture diagrams, drawn as SVG

They are not installed with the package (`pip install .`): they work on a checkout.
"""
