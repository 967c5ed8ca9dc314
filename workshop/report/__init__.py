"""Reports: reproducing the README's results, their pages and figures."""
