"""atoll.train"""
