"""torchio"""
