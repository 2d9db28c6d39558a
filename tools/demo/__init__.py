"""The demo expert set (`make experts`, docs/experts.md#the-demo-expert-set): skills that generate
their data from a seed, the recipes that train them, and the builder that trains, signs and installs."""
