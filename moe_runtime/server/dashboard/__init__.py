"""The live expert-load dashboard served by moe-serve at /dashboard (see `routes`)."""
from moe_runtime.server.dashboard.monitor import DashboardConfig, DashboardMonitor
from moe_runtime.server.dashboard.routes import dashboard_router

__all__ = ["DashboardConfig", "DashboardMonitor", "dashboard_router"]
