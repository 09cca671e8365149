"""`dynatrain selfcheck`: train with layout switches and check every switch against an independent oracle."""
