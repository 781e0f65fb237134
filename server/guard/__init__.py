"""Content inspection: data-loss prevention (Presidio's pattern recognizers) and guardrails
(a classification model), on prompts before the caches and the backend see them and on
answers before the client and the caches do. The serving core calls it; it knows no route
or surface, and never HTTP."""
