"""podium's backend-neutral core. Import the public API from ``podium``; these modules may change."""
