"""atoll.tasks"""
